"""The C kernels of kernels/cpu (attention.c, ops.c) against torch references, and their fallbacks.

Attention: random steps over shuffled (non-contiguous) block tables, mixing decodes at odd lengths
and at block boundaries, several-token queries over cached context (speculative rows) and fresh
chunks, for GQA ratios 1/3/4, MQA, head dims with and without the SIMD path, sliding windows, fp32
and bf16 caches; checked against dense fp64 attention written independently here. The fused ops
against the torch code they replace. With ``ASYNCENGINE_CPU_KERNELS=0`` every wrapper runs its
torch path and gives the reference's numbers.

These tests need the kernels built (a C compiler): where none is found they fail, saying so.
"""
from __future__ import annotations

import random

import pytest
import torch

from asyncengine.kernels.cpu import attention as A
from asyncengine.kernels.cpu import build, ops


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    if not A.available():
        pytest.fail(f"the CPU kernels did not build here: {build.build_error()}", pytrace=False)


def dense(q, keys, vals, ctx, scale, window, softcap=None):
    """q: [n, Hq, D] at positions ctx.., keys/vals: [ctx + n, Hkv, D]; causal (and windowed, and
    soft-capped: scores -> softcap * tanh(scores / softcap)), fp64."""
    n, hq, d = q.shape
    total, hk = keys.shape[0], keys.shape[1]
    g = hq // hk
    kd, vd = keys.double().repeat_interleave(g, 1), vals.double().repeat_interleave(g, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kd) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(ctx, total)[:, None]
    key = torch.arange(total)[None, :]
    allowed = key <= pos
    if window is not None:
        allowed &= key > pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vd)


# (query_len, context_len) of each sequence: odd lengths, a decode filling a block's last slot, a
# decode opening a new block, speculative rows, fresh chunks, a long one
STEP = [(1, 36), (1, 0), (1, 15), (1, 16), (1, 7), (4, 5), (3, 29), (16, 0), (13, 0), (9, 40), (1, 71)]


def make_step(hq, hk, d, bs, dtype, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    need = sum(-(-(c + n) // bs) for n, c in STEP)
    nb = need + 5
    perm = rng.sample(range(nb), nb)  # shuffled: no sequence's blocks are contiguous or ordered
    k_cache = torch.randn(hk, nb, bs, d).to(dtype)
    v_cache = torch.randn(hk, nb, bs, d).to(dtype)
    seqs, used, row = [], 0, 0
    for n, c in STEP:
        blocks = perm[used:used + -(-(c + n) // bs)]
        used += len(blocks)
        seqs.append((row, n, c, blocks))
        row += n
    # q as the model has it: a strided view of a fused projection
    qkv = torch.randn(row, (hq + 2 * hk) * d).to(dtype)
    return qkv[:, :hq * d].view(row, hq, d), k_cache, v_cache, seqs


def cached(cache, blocks, total, bs):
    """[total, Hkv, D] of a sequence, read back from the paged cache."""
    idx = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(total)])
    hk, d = cache.shape[0], cache.shape[3]
    return cache.view(hk, -1, d)[:, idx].transpose(0, 1)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d,bs", [
    (9, 3, 64, 16),  # the default model's shape: GQA 3
    (8, 8, 128, 16),  # ratio 1, head dim 128
    (8, 2, 32, 8),  # GQA 4
    (6, 1, 40, 16),  # MQA, a head dim of the SIMD path that is not 64/128
    (4, 2, 10, 4),  # a head dim and block size off the SIMD path (scalar code)
    (32, 8, 64, 32),  # more than one row tile per kv head (4 x query_len rows)
])
def test_paged_attention_matches_dense(hq, hk, d, bs, dtype, window):
    q, k_cache, v_cache, seqs = make_step(hq, hk, d, bs, dtype, seed=hq * d + bs)
    batch = A.PagedBatch.build(seqs[1:], bs)  # the first sequence is not the kernel's: its rows stay
    scale = d ** -0.5
    out = torch.full(q.shape, 7.0, dtype=dtype)
    A.paged_attention(q, k_cache, v_cache, batch, scale, out, window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert torch.all(out[:1] == 7.0), "rows of a sequence not in the batch were written"
    for q0, n, c, blocks in seqs[1:]:
        keys, vals = cached(k_cache, blocks, c + n, bs), cached(v_cache, blocks, c + n, bs)
        want = dense(q[q0:q0 + n], keys, vals, c, scale, window)
        torch.testing.assert_close(out[q0:q0 + n].double(), want, atol=tol, rtol=tol)
    # the torch fallback of the wrapper computes the same
    ref = torch.full(q.shape, 7.0, dtype=dtype)
    A.paged_attention_torch(q, k_cache, v_cache, batch, scale, ref, window)
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


def test_paged_attention_more_sequences_than_the_stack_table():
    """Past 1,024 sequences the items' per-sequence table moves from the stack to the heap: every
    sequence, decodes and a few prefill rows among them, still finds its own rows."""
    rng = random.Random(13)
    torch.manual_seed(13)
    bs, hk, hq, d = 16, 1, 2, 32
    seqs, row, used = [], 0, 0
    for i in range(1100):
        n, c = (3, rng.randrange(0, 20)) if i % 97 == 0 else (1, rng.randrange(0, 40))
        k = -(-(c + n) // bs)
        seqs.append((row, n, c, list(range(used, used + k))))
        row, used = row + n, used + k
    k_cache, v_cache = torch.randn(hk, used, bs, d), torch.randn(hk, used, bs, d)
    q = torch.randn(row, hq, d)
    batch = A.PagedBatch.build(seqs, bs)
    out, ref = torch.empty_like(q), torch.empty_like(q)
    A.paged_attention(q, k_cache, v_cache, batch, d ** -0.5, out)
    A.paged_attention_torch(q, k_cache, v_cache, batch, d ** -0.5, ref)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_paged_attention_parallel_equals_serial(monkeypatch):
    """Splitting the items over the OpenMP threads changes nothing: each item is computed alike."""
    q, k_cache, v_cache, seqs = make_step(8, 2, 64, 16, torch.float32, seed=3)
    batch = A.PagedBatch.build(seqs, 16)
    outs = []
    for threshold in (1 << 62, 0):
        monkeypatch.setattr(A, "PARALLEL_MIN_WORK", threshold)
        out = torch.empty(q.shape)
        A.paged_attention(q, k_cache, v_cache, batch, 0.125, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_through_slot_mapping(dtype):
    torch.manual_seed(0)
    hk, nb, bs, d, t = 3, 10, 4, 16, 7
    kv = torch.randn(t, 2 * hk * d + 5).to(dtype)  # k and v: strided views of one projection
    k, v = kv[:, :hk * d].view(t, hk, d), kv[:, hk * d:2 * hk * d].view(t, hk, d)
    slots = torch.tensor([13, 0, 39, -1, 22, 5, 6])  # -1: a padding token, not written
    base = [torch.randn(hk, nb, bs, d).to(dtype) for _ in range(2)]
    caches = [t.clone() for t in base + base]
    A.write_kv(k, v, caches[0], caches[1], slots)
    want_k, want_v = caches[2], caches[3]
    keep = slots >= 0
    want_k.view(hk, -1, d)[:, slots[keep]] = k[keep].transpose(0, 1)
    want_v.view(hk, -1, d)[:, slots[keep]] = v[keep].transpose(0, 1)
    assert torch.equal(caches[0], want_k) and torch.equal(caches[1], want_v)


def test_write_and_attend_is_write_then_attend():
    """The one-call form a layer uses equals the two calls (the step's keys attended after the write)."""
    q, k_cache, v_cache, seqs = make_step(9, 3, 64, 16, torch.float32, seed=4)
    t = q.shape[0]
    k, v = torch.randn(t, 3, 64), torch.randn(t, 3, 64)
    slots = torch.tensor([blocks[p // 16] * 16 + p % 16 for _, n, c, blocks in seqs for p in range(c, c + n)])
    batch = A.PagedBatch.build(seqs, 16)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    one, two = torch.empty(q.shape), torch.empty(q.shape)
    A.write_and_attend(q, k, v, k_cache, v_cache, slots, batch, 0.125, one, 5)
    A.write_kv(k, v, kc2, vc2, slots)
    A.paged_attention(q, kc2, vc2, batch, 0.125, two, 5)
    assert torch.equal(k_cache, kc2) and torch.equal(v_cache, vc2) and torch.equal(one, two)


# ---------------------------------------------------------------------------- fused ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    torch.manual_seed(0)
    w = torch.randn(96).to(dtype)
    x = (torch.randn(5, 96) * 3).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_torch(x, w, 1e-6), **tol)
    # per-head norms over a strided [T, H, D] view of a fused projection (Qwen3's q/k norm)
    proj = torch.randn(5, 7 * 16 + 3).to(dtype)
    heads = proj[:, 16:6 * 16].view(5, 5, 16)
    wh = torch.randn(16).to(dtype)
    torch.testing.assert_close(ops.rms_norm(heads, wh, 1e-6), ops.rms_norm_torch(heads, wh, 1e-6), **tol)
    # a big batch (the parallel path)
    xb = torch.randn(1024, 96).to(dtype)
    torch.testing.assert_close(ops.rms_norm(xb, w, 1e-6), ops.rms_norm_torch(xb, w, 1e-6), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(dtype):
    torch.manual_seed(1)
    w = torch.randn(64).to(dtype)
    for rows in (1, 3, 2048):
        x, r = torch.randn(rows, 64).to(dtype), torch.randn(rows, 64).to(dtype)
        out, s = ops.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(s, x + r)  # the sum rounded to the dtype once, as torch's add
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(out, ops.rms_norm_torch(x + r, w, 1e-5), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_exact(dtype):
    """The same roundings as the torch expression: bit-identical results."""
    torch.manual_seed(2)
    t, hq, hk, d = 6, 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d).to(dtype)
    qk = qkv[:, :(hq + hk) * d].view(t, hq + hk, d)  # strided over tokens, as the model passes it
    cos, sin = torch.randn(t, 1, d).to(dtype), torch.randn(t, 1, d).to(dtype)
    got = ops.rotary(qk, cos, sin)
    assert torch.equal(got, ops.rotary_torch(qk, cos, sin))
    assert torch.equal(qkv[:, :(hq + hk) * d].view(t, hq + hk, d), qk)  # input untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    torch.manual_seed(3)
    for rows, inter in ((1, 1536), (4, 37), (300, 256)):  # 37: the scalar tail after 8-wide lanes
        x = (torch.randn(rows, 2 * inter) * 4).to(dtype)
        tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(ops.silu_and_mul(x), ops.silu_and_mul_torch(x), **tol)


def test_unsupported_inputs_take_the_torch_path():
    """float16 (no kernel) and mismatched dtypes still compute, through torch."""
    x = torch.randn(3, 32).half()
    w = torch.randn(32).half()
    assert torch.equal(ops.rms_norm(x, w, 1e-6), ops.rms_norm_torch(x, w, 1e-6))
    xf = torch.randn(3, 32)
    torch.testing.assert_close(ops.rms_norm(xf, w, 1e-6), ops.rms_norm_torch(xf, w, 1e-6))
    assert torch.equal(ops.silu_and_mul(x), ops.silu_and_mul_torch(x))


def test_fallbacks_with_kernels_off(kernels_off):
    """ASYNCENGINE_CPU_KERNELS=0: no library, every wrapper computes through torch."""
    assert not A.available() and build.load() is None and "ASYNCENGINE_CPU_KERNELS" in build.build_error()
    q, k_cache, v_cache, seqs = make_step(9, 3, 64, 16, torch.float32, seed=5)
    batch = A.PagedBatch.build(seqs, 16)
    out = torch.empty(q.shape)
    A.paged_attention(q, k_cache, v_cache, batch, 0.125, out, None)
    for q0, n, c, blocks in seqs:
        want = dense(q[q0:q0 + n], cached(k_cache, blocks, c + n, 16), cached(v_cache, blocks, c + n, 16), c,
                     0.125, None)
        torch.testing.assert_close(out[q0:q0 + n].double(), want, atol=2e-5, rtol=2e-5)
    k = torch.randn(2, 3, 64)
    A.write_kv(k, k + 1, k_cache, v_cache, torch.tensor([3, -1]))
    assert torch.equal(k_cache[:, 0, 3], k[0]) and torch.equal(v_cache[:, 0, 3], k[0] + 1)
    x, w = torch.randn(4, 64), torch.randn(64)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), ops.rms_norm_torch(x, w, 1e-6))
    assert torch.equal(ops.silu_and_mul(x), ops.silu_and_mul_torch(x))
