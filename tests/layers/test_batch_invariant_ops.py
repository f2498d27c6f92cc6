"""Batch invariance of every op on the model's path, bitwise: a row computed in a batch of M rows
(any M, any position among them, any thread count) equals the same row computed alone.

Each test of an op we replace also shows the op it replaces is *not* invariant on the same shapes
(else the test could not tell the two apart).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from asyncengine.kernels.cpu import invariant, ops, quant
from asyncengine.layers.linear import Linear

DTYPES = (torch.float32, torch.bfloat16)
MS = (1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 48, 64, 100)


def rows_alone_equal(fn, x: torch.Tensor, ms=MS) -> bool:
    """fn(x[s:s+m]) == fn(x)[s:s+m] bitwise for every m in ms and two starts."""
    full = fn(x)
    return all(torch.equal(fn(x[s:s + m]), full[s:s + m]) for m in ms for s in (0, 3) if s + m <= x.shape[0])


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


# ---------------------------------------------------------------------------- dense matmul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(64, 192), (100, 37), (512, 1536), (1408, 512)])
def test_invariant_linear_is_batch_invariant(dtype, k, n):
    g = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(103, k, generator=g).to(dtype)
    assert rows_alone_equal(lambda t: invariant.linear(t, w, b), x)
    assert rows_alone_equal(lambda t: invariant.linear(t, w), x)
    # close to the BLAS (fp32: reassociation only; bf16: both round the fp32 sum to bf16)
    ref = F.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(invariant.linear(x, w, b).float(), ref, rtol=tol, atol=tol * k ** 0.5)


def test_default_fp32_linear_is_not_batch_invariant():
    """What the mode fixes: oneDNN's fp32 blocking follows M on this kind of machine."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(192, 64, generator=g), torch.randn(103, 64, generator=g)
    assert not rows_alone_equal(lambda t: F.linear(t, w), x)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 200), n=st.integers(1, 50), start=st.integers(0, 5),
       bf16=st.booleans(), bias=st.booleans())
def test_invariant_linear_any_shape(m, k, n, start, bf16, bias):
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    x = torch.randn(start + m + 4, k, generator=g).to(dtype)
    full = invariant.linear(x, w, b)
    part = invariant.linear(x[start:start + m], w, b)
    assert torch.equal(part, full[start:start + m])
    assert torch.equal(invariant.linear(x[start:start + 1], w, b), full[start:start + 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_linear_thread_count_does_not_change_bits(dtype, threads):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(1536, 512, generator=g).to(dtype), torch.randn(37, 512, generator=g).to(dtype)
    torch.set_num_threads(1)
    one = invariant.linear(x, w)
    torch.set_num_threads(2)
    assert torch.equal(invariant.linear(x, w), one)


def test_invariant_linear_strided_rows():
    """A view whose rows are further apart than K (a slice of a fused projection) reads the same."""
    g = torch.Generator().manual_seed(2)
    big = torch.randn(20, 96, generator=g)
    w = torch.randn(24, 64, generator=g)
    assert torch.equal(invariant.linear(big[:, :64], w), invariant.linear(big[:, :64].contiguous(), w))


def test_rowwise_fallback_is_batch_invariant(monkeypatch):
    """Without the C library, one F.linear per row: M = 1 every time."""
    monkeypatch.setattr(invariant._lib, "_fns", False)
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(192, 64, generator=g), torch.randn(40, 64, generator=g)
    assert not invariant.kernel_applies(x, w, None)
    assert rows_alone_equal(lambda t: invariant.linear(t, w), x, ms=(1, 2, 5, 17))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_layer_switches(dtype):
    layer = Linear(64, 96, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(50, 64).to(dtype)
    layer.batch_invariant = True
    assert torch.equal(layer(x), invariant.linear(x, layer.weight, layer.bias))
    assert rows_alone_equal(layer, x)


# ---------------------------------------------------------------------------- quantized matmul


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize("activations", ["int8", "fp32"])
def test_quant_gemm_fixed_order_is_batch_invariant(qtype, activations):
    """fixed_order keeps the per-row kernel past LARGE_M. By default fp32 activations switch to
    dequantize + torch.mm there (not invariant); int8 activations run their integer kernel at every
    M (invariant by construction: the mode relies on it)."""
    g = torch.Generator().manual_seed(4)
    k, n = 256, 200
    w = quant.quantize(torch.randn(n, k, generator=g), qtype)
    x = torch.randn(quant.LARGE_M + 30, k, generator=g)

    def fixed(t):
        return quant.gemm(t, w, qtype, k, activations=activations, fixed_order=True)

    assert rows_alone_equal(fixed, x, ms=(1, 2, 3, 4, 5, 9, quant.LARGE_M, quant.LARGE_M + 7))
    default_full = quant.gemm(x, w, qtype, k, activations=activations)
    one = quant.gemm(x[:1], w, qtype, k, activations=activations)
    assert torch.equal(default_full[:1], one) == (activations == "int8")


# ---------------------------------------------------------------------------- the per-row ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_rotary_activation_are_per_row(dtype):
    g = torch.Generator().manual_seed(5)
    dim = 512
    x = (torch.randn(300, dim, generator=g) * 3).to(dtype)
    r = torch.randn(300, dim, generator=g).to(dtype)
    w = torch.randn(dim, generator=g).to(dtype)
    assert rows_alone_equal(lambda t: ops.rms_norm(t, w, 1e-6), x)
    full_n, full_s = ops.add_rms_norm(x, r, w, 1e-6)
    for m in (1, 3, 100, 257):
        n, s = ops.add_rms_norm(x[:m], r[:m], w, 1e-6)
        assert torch.equal(n, full_n[:m]) and torch.equal(s, full_s[:m])
    assert rows_alone_equal(ops.silu_and_mul, torch.cat([x, r], dim=-1))
    heads = x.view(300, 8, 64)
    cos, sin = torch.randn(300, 1, 64, generator=g).to(dtype), torch.randn(300, 1, 64, generator=g).to(dtype)
    full = ops.rotary(heads, cos, sin)
    for m in (1, 7, 130):
        assert torch.equal(ops.rotary(heads[:m], cos[:m], sin[:m]), full[:m])


@pytest.mark.parametrize("vocab", [512, 32000, 151936])
def test_torch_log_softmax_and_softmax_are_per_row(vocab, threads):
    """The sampler keeps torch's log_softmax/softmax: each row is reduced alone, at any thread count."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, vocab, generator=g) * 5
    for n in (1, 2):
        torch.set_num_threads(n)
        assert rows_alone_equal(lambda t: t.log_softmax(-1), x, ms=(1, 2, 3, 17))
        assert rows_alone_equal(lambda t: t.softmax(-1), x, ms=(1, 2, 3, 17))


# ---------------------------------------------------------------------------- tensor parallel


def _tp_rank(rank: int, size: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from asyncengine.layers.parallel import TPGroup

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        tp = TPGroup(rank=rank, size=size, group=dist.group.WORLD, fixed_order=True)
        parts = [torch.randn(37, 300, generator=torch.Generator().manual_seed(r)) * 10 ** r for r in range(size)]
        got = tp.all_reduce(parts[rank].clone())
        one_row = tp.all_reduce(parts[rank][5:6].clone())
        if rank == size - 1:
            torch.save({"got": got, "one_row": one_row, "parts": parts}, out)
    finally:
        dist.destroy_process_group()


def test_tp_fixed_order_all_reduce_sums_in_rank_order(tmp_path):
    """Three ranks (where a ring's order would follow the tensor size): every element is
    ((p0 + p1) + p2), for a batch of 37 rows and for one row alone."""
    import torch.multiprocessing as mp

    size, out = 3, str(tmp_path / "out.pt")
    mp.start_processes(_tp_rank, args=(size, f"file://{tmp_path / 'init'}", out), nprocs=size, join=True,
                       start_method="spawn")
    res = torch.load(out)
    p = res["parts"]
    expect = (p[0] + p[1]) + p[2]
    assert torch.equal(res["got"], expect)
    assert torch.equal(res["one_row"], expect[5:6])
