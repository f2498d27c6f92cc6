"""The 8-bit KV cache's C kernels (kernels/cpu/attention_i8.c) against their torch reference
(kernels/cpu/attention_i8.py): the quantized rows bit for bit, and the attention over them at every
ISA level this CPU runs (portable C, AVX2, AVX-512, and AVX-512 VNNI: query rows rounded to int8 for
QK, and the reference rounds them the same way), with random lengths crossing block boundaries,
GQA/MQA, prefill chunks after cached context, sliding windows and soft-capping. Also: the int8
cache against the exact (unquantized) attention, within what 8 bits allow.
"""
from __future__ import annotations

import random

import pytest
import torch

from asyncengine.kernels.cpu import attention as A
from asyncengine.kernels.cpu import attention_i8 as Q
from asyncengine.kernels.cpu import build, isa


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    if not Q.available():
        pytest.fail(f"the CPU kernels did not build here: {build.build_error()}", pytrace=False)


# (ISA level, VNNI loop on): every loop of attention_i8*.c; the VNNI loop runs at the AVX-512 levels
# where it applies (head dim % 64, block size % 16), so those levels also run with it off
PATHS = [("scalar", True), ("avx2", True), ("avx512_vnni", True), ("avx512_vnni", False), ("avx512_bf16", True)]


@pytest.fixture(params=PATHS, ids=[f"{lv}-{'vnni' if f else 'fp32-loops'}" for lv, f in PATHS])
def path(request):
    level, fast = request.param
    best = isa.cpu_isa()
    if isa.ISAS.index(level) > isa.ISAS.index(best):
        pytest.skip(f"this CPU (or its OS) runs at most {best}, not {level}")
    assert isa.set_isa(level) == level
    Q.set_fast(fast)
    yield level, fast
    isa.set_isa("auto")
    Q.set_fast(True)


def make_step(hq, hk, d, bs, dtype, seed):
    """A step of random sequences (query_len, context) over shuffled blocks: the step's K/V and
    the cached context's, the latter already quantized into the cache (written by the reference)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shapes = [(1, rng.randint(0, 70)) for _ in range(5)] + [(rng.randint(2, 40), rng.randint(0, 50)), (3, 0)]
    nb = sum(-(-(c + n) // bs) for n, c in shapes) + 4
    perm = rng.sample(range(nb), nb)
    k_cache = torch.zeros(Q.cache_shape(nb, bs, hk, d), dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    seqs, used, row, slots = [], 0, 0, []
    for n, c in shapes:
        blocks = perm[used:used + -(-(c + n) // bs)]
        used += len(blocks)
        ctx_slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(c)], dtype=torch.long)
        Q.write_kv_torch(torch.randn(c, hk, d).to(dtype), torch.randn(c, hk, d).to(dtype), k_cache, v_cache, ctx_slots)
        slots += [blocks[p // bs] * bs + p % bs for p in range(c, c + n)]
        seqs.append((row, n, c, blocks))
        row += n
    qkv = torch.randn(row, (hq + 2 * hk) * d).to(dtype) * 2  # q, k, v as the model has them: views of one
    q, k, v = qkv.view(row, hq + 2 * hk, d).split([hq, hk, hk], dim=1)
    return q, k, v, k_cache, v_cache, torch.tensor(slots, dtype=torch.long), seqs


def test_quantize_rows_round_trip():
    x = torch.randn(50, 3, 64) * 4
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    rows = Q.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 66)
    back = Q.dequantize_rows(rows)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.equal(back[0, 0], torch.zeros(64))
    assert bool(((back - x).abs() <= amax / 127 * 0.5 + amax * 1e-3).all())  # half a step (+ the half scale)
    assert int(rows[..., :64].abs().max()) == 127


@pytest.mark.parametrize("window,softcap", [(None, None), (9, 20.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d,bs", [
    (9, 3, 64, 16),  # the default model: GQA 3, the AVX-512 path
    (8, 2, 128, 32),  # GQA 4, head dim 128, two key tiles per block
    (4, 1, 40, 8),  # MQA; block size 8 and head dim % 16 != 0: the AVX2 path at AVX-512 levels
    (32, 8, 64, 16),  # several row tiles per kv head
    (4, 2, 10, 4),  # off every vector path (portable C)
])
def test_kernel_matches_torch_reference(path, hq, hk, d, bs, dtype, window, softcap):
    level, fast = path
    q, k, v, kc, vc, slots, seqs = make_step(hq, hk, d, bs, dtype, seed=hq * d + bs)
    batch = A.PagedBatch.build(seqs, bs)
    scale = d ** -0.5
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out = torch.full(q.shape, 7.0, dtype=dtype)
    want = torch.full(q.shape, 7.0, dtype=dtype)
    Q.write_and_attend(q, k, v, kc, vc, slots, batch, scale, out, window, softcap)
    vnni = fast and level.startswith("avx512") and d % 64 == 0 and bs % 16 == 0
    Q.write_and_attend(q, k, v, kc_ref, vc_ref, slots, batch, scale, want, window, softcap, use_kernel=False,
                       round_queries=vnni)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # the written rows, bit for bit
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("hq,hk,d,bs", [(9, 3, 64, 16), (8, 2, 128, 32)])
def test_int8_cache_close_to_exact_attention(hq, hk, d, bs):
    """What quantizing costs: the int8 cache's output against attention over the unquantized K/V
    (the bf16/fp32 cache's), on random data: error well under the outputs' own scale."""
    torch.manual_seed(1)
    n = 300
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hk, d), torch.randn(n, hk, d)
    nb = -(-n // bs)
    blocks = list(range(nb))[::-1]
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)], dtype=torch.long)
    batch = A.PagedBatch.build([(0, n, 0, blocks)], bs)
    kc = torch.zeros(Q.cache_shape(nb, bs, hk, d), dtype=torch.int8)
    vc = torch.zeros_like(kc)
    out = torch.empty(q.shape)
    Q.write_and_attend(q, k, v, kc, vc, slots, batch, d ** -0.5, out)
    kf, vf = torch.zeros(hk, nb, bs, d), torch.zeros(hk, nb, bs, d)
    want = torch.empty(q.shape)
    A.write_kv(k, v, kf, vf, slots)
    A.paged_attention_torch(q, kf, vf, batch, d ** -0.5, want)
    err = (out - want).abs()
    assert float(err.max()) < 0.05 and float(err.mean()) < 5e-3, (float(err.max()), float(err.mean()))
