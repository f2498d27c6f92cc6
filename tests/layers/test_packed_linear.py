"""layers/packed_linear.py: the oneDNN-packed dense projections against F.linear (bf16 bit for
bit, fp32 to summation order), which layers get packed, and the switch that turns it off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch import nn

from asyncengine.layers import packed_linear
from asyncengine.layers.linear import Linear

pytestmark = pytest.mark.skipif(not packed_linear.available(),
                                reason="this torch build has no oneDNN (mkldnn) linear ops")


def dense_linear(k, n, dtype, bias=False, seed=0):
    torch.manual_seed(seed)
    m = Linear(k, n, bias=bias)
    with torch.no_grad():
        m.weight.copy_(torch.randn(n, k) * k ** -0.5)
        if bias:
            m.bias.copy_(torch.randn(n))
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(dtype, bias):
    m = dense_linear(96, 80, dtype, bias)
    assert packed_linear.prepack(m) == 1 and m.onednn_weight is not None
    for rows in (1, 7, 300):
        x = torch.randn(rows, 96).to(dtype)
        got, want = m(x), F.linear(x, m.weight, m.bias)
        assert got.shape == want.shape and got.dtype == dtype
        if dtype == torch.bfloat16:
            torch.testing.assert_close(got, want, atol=0, rtol=0)  # bf16: what F.linear's oneDNN call gives
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # leading dims, a strided input (F.linear then rounds x W^T to bf16 before adding the bias; the
    # packed call adds it in fp32: bf16 results within one rounding)
    x3 = torch.randn(2, 5, 96).to(dtype)[:, ::2]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(m(x3), F.linear(x3, m.weight, m.bias), **tol)


@given(st.integers(1, 1 << 16))
def test_row_buckets_bound_the_padding_and_the_shapes(m):
    b = packed_linear.bucket_rows(m)
    assert m <= b <= m + m // packed_linear.ROW_BUCKETS_PER_OCTAVE
    assert packed_linear.bucket_rows(b) == b  # a bucket is its own bucket
    if m <= packed_linear.EXACT_ROWS:
        assert b == m


def test_row_buckets_per_octave():
    """The point of the buckets: a bounded number of shapes for oneDNN to compile and cache."""
    sizes = {packed_linear.bucket_rows(m) for m in range(1, 4097)}
    assert len(sizes) == packed_linear.EXACT_ROWS + packed_linear.ROW_BUCKETS_PER_OCTAVE * 7


def test_padded_rows_leave_the_real_rows_unchanged():
    """Row counts that are padded up to a bucket (33-70 rows) give F.linear's bf16 bits, row for row:
    the padding's zero rows change nothing but the time."""
    m = dense_linear(64, 48, torch.bfloat16, bias=False)
    packed_linear.prepack(m)
    x = torch.randn(70, 64).to(torch.bfloat16)
    padded = [rows for rows in range(33, 71) if packed_linear.bucket_rows(rows) != rows]
    assert padded
    for rows in padded:
        got = m(x[:rows])
        assert got.shape == (rows, 48)
        torch.testing.assert_close(got, F.linear(x[:rows], m.weight), atol=0, rtol=0)


def test_what_gets_packed(monkeypatch):
    model = nn.ModuleList([dense_linear(64, 32, torch.float32), dense_linear(64, 32, torch.float16),
                           dense_linear(64, 32, torch.bfloat16)])
    quantized = Linear(64, 32)
    quantized.quantize_as("Q8_0")
    invariant_layer = dense_linear(64, 32, torch.float32)
    invariant_layer.batch_invariant = True  # its own kernel (layers/batch_invariant.py)
    model.extend([quantized, invariant_layer])
    assert packed_linear.prepack(model) == 2
    assert [m.onednn_weight is not None for m in model] == [True, False, True, False, False]
    monkeypatch.setenv("ASYNCENGINE_PREPACK", "0")
    fresh = dense_linear(64, 32, torch.float32)
    assert packed_linear.prepack(fresh) == 0 and fresh.onednn_weight is None


def test_no_copies_beyond_the_memory_share(monkeypatch):
    """The packed copies double dense weights: they are made only while they fit in the share of
    available memory, all or none."""
    model = nn.ModuleList([dense_linear(64, 32, torch.float32), dense_linear(64, 32, torch.float32)])
    need = 2 * 64 * 32 * 4
    monkeypatch.setattr(packed_linear, "available_memory_bytes", lambda: int(need / packed_linear.MEMORY_SHARE) - 1)
    assert packed_linear.prepack(model) == 0 and all(m.onednn_weight is None for m in model)
    monkeypatch.setattr(packed_linear, "available_memory_bytes", lambda: int(need / packed_linear.MEMORY_SHARE) + 4)
    assert packed_linear.prepack(model) == 2 and all(m.onednn_weight is not None for m in model)
    assert packed_linear.available_memory_bytes() > 0
