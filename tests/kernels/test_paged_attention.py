"""paged_attention (Triton) vs paged_attention_ref (torch) vs dense causal SDPA.

Sizes are tiny on purpose: off-GPU the kernel runs in triton's (slow) CPU interpreter.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch
import torch.nn.functional as F

from asyncengine.kernels import paged_attention, paged_attention_ref, reshape_and_cache

TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def dense_causal(q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense reference for ONE request: the q_rows are the LAST q_len positions of the sequence.

    Runs causal SDPA over the whole sequence (queries at positions < seq_len - q_len are filler) and keeps
    the last q_len rows, so positions are aligned exactly like the paged kernels must align them.
    """
    seq_len, q_len = k.shape[0], q_rows.shape[0]
    hq, hkv = q_rows.shape[1], k.shape[1]
    q_full = torch.zeros(seq_len, hq, q_rows.shape[2], dtype=torch.float32, device=q_rows.device)
    q_full[seq_len - q_len:] = q_rows.float()
    o = F.scaled_dot_product_attention(
        q_full.transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        is_causal=True, scale=scale, enable_gqa=hq != hkv,
    )
    return o.transpose(0, 1)[seq_len - q_len:]


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


# ------------------------------------------------------------------------------------------
# The reference itself, against dense SDPA (so kernel and reference can't share one mistake)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "q_lens,seq_lens,hq,hkv,d,bs",
    [
        ([7, 1, 16], [7, 23, 40], 4, 4, 16, 16),  # full prefill, decode, chunk ending at a block edge
        ([1, 5, 32], [17, 33, 32], 6, 2, 32, 16),  # GQA, chunk crossing block edges, seq == 2 blocks
        ([3, 1], [50, 64], 8, 1, 64, 32),  # MQA, bigger blocks
    ],
)
def test_reference_matches_dense_sdpa(paged_batch, q_lens, seq_lens, hq, hkv, d, bs):
    batch = paged_batch(q_lens, seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs)
    out = paged_attention_ref(*batch.args())
    qsl = batch.query_start_loc.tolist()
    for b in range(len(q_lens)):
        want = dense_causal(batch.q[qsl[b]:qsl[b + 1]], batch.keys[b], batch.values[b], batch.scale)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]], want, atol=1e-5, rtol=1e-5)


def test_reference_full_prefill_is_plain_causal_sdpa(paged_batch):
    """q_len == seq_len: exactly SDPA(is_causal=True) on the sequence, no offset games."""
    batch = paged_batch([19], [19], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    out = paged_attention_ref(*batch.args())
    want = F.scaled_dot_product_attention(
        batch.q.transpose(0, 1), batch.keys[0].transpose(0, 1), batch.values[0].transpose(0, 1),
        is_causal=True, scale=batch.scale, enable_gqa=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# Triton kernel vs reference
# ------------------------------------------------------------------------------------------


CASES = {
    # name: (q_lens, seq_lens, hq, hkv, d, block_size, dtype)
    "mixed_gqa_fp32": ([5, 1, 1, 20], [9, 17, 33, 20], 4, 2, 32, 16, torch.float32),
    "decode_only_fp32": ([1, 1, 1], [1, 16, 47], 4, 4, 64, 16, torch.float32),
    "block_edges_fp32": ([16, 1, 17], [32, 16, 33], 2, 1, 16, 16, torch.float32),
    "mqa_group3_bs32": ([3, 1, 8], [35, 64, 8], 3, 1, 32, 32, torch.float32),
    "empty_request": ([4, 0, 1], [4, 9, 12], 4, 2, 16, 16, torch.float32),
    "mixed_gqa_bf16": ([6, 1, 12], [30, 45, 12], 8, 2, 64, 16, torch.bfloat16),
    "decode_bf16": ([1, 1], [20, 50], 4, 1, 32, 16, torch.bfloat16),
    "mixed_fp16": ([2, 1, 9], [18, 3, 9], 4, 2, 32, 16, torch.float16),
    "head_dim_48": ([4, 1], [20, 30], 2, 2, 48, 16, torch.float32),  # non-power-of-two D (padded)
    "block_size_24": ([5, 1], [29, 50], 4, 2, 16, 24, torch.float32),  # non-pow2 block: per-key gather
    "block_size_64": ([9, 1], [70, 65], 2, 1, 16, 64, torch.float32),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(paged_batch, name):
    q_lens, seq_lens, hq, hkv, d, bs, dtype = CASES[name]
    batch = paged_batch(q_lens, seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype)
    out = paged_attention(*batch.args())
    ref = paged_attention_ref(*batch.args())
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert torch.isfinite(out.float()).all()
    check_close(out, ref, dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_decode(paged_batch, num_splits, dtype):
    """Flash-decoding path: keys split over programs, partial softmax states merged."""
    # seq 5 leaves most splits empty; 64 puts a split edge on a block edge.
    batch = paged_batch([1, 1, 1], [5, 64, 41], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                        dtype=dtype, seed=num_splits)
    out = paged_attention(*batch.args(), num_splits=num_splits)
    check_close(out, paged_attention_ref(*batch.args()), dtype)


def test_decode_graph_padding_with_dummy_requests(paged_batch):
    """CUDA-graph style decode padding: dummy requests with q_len 1 and seq_len 0 give zeros, no NaN."""
    batch = paged_batch([1, 1], [9, 30], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16, pad_tokens=2)
    q, kc, vc, bt, seq_lens, qsl, scale = batch.args()
    bt = torch.cat([bt, torch.zeros_like(bt[:2])])  # dummy rows: point at block 0, must never be read
    seq_lens = torch.cat([seq_lens, seq_lens.new_zeros(2)])
    qsl = torch.arange(5, dtype=torch.int32, device=q.device)
    out = paged_attention(q, kc, vc, bt, seq_lens, qsl, scale, max_query_len=1)
    check_close(out[:2], paged_attention_ref(*batch.args())[:2], torch.float32)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))


@pytest.mark.parametrize("max_query_len", [None, 1, 64])
def test_max_query_len_hint_only_tunes(paged_batch, max_query_len):
    """The hint picks tile sizes only: even a wrong hint (1 for a prefill batch) stays correct."""
    batch = paged_batch([7, 1], [20, 18], num_q_heads=4, num_kv_heads=1, head_dim=16, block_size=16)
    out = paged_attention(*batch.args(), max_query_len=max_query_len)
    check_close(out, paged_attention_ref(*batch.args()), torch.float32)


def test_split_k_mixed_batch(paged_batch):
    """Splitting is also correct for prefill chunks (rows whose keys all sit in later splits)."""
    batch = paged_batch([6, 1], [40, 20], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    out = paged_attention(*batch.args(), num_splits=4)
    check_close(out, paged_attention_ref(*batch.args()), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_strided_q_out_and_padding_rows(paged_batch, num_splits):
    """q sliced from a fused projection, caller-provided strided `out`, graph-padding rows untouched."""
    batch = paged_batch([3, 1], [10, 27], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                        pad_tokens=3, strided_q=True)
    assert not batch.q.is_contiguous()
    t = batch.q.shape[0]
    big = torch.full((t, 6, 16), 7.0, device=batch.q.device)
    out = big[:, 1:5]
    ret = paged_attention(*batch.args(), out=out, num_splits=num_splits)
    assert ret.data_ptr() == out.data_ptr()
    ref = paged_attention_ref(*batch.args())
    n = sum(batch.q_lens)
    check_close(out[:n], ref[:n], torch.float32)
    assert (big[n:] == 7.0).all(), "padding rows past query_start_loc[-1] must not be written"
    assert (big[:, 0] == 7.0).all() and (big[:, 5] == 7.0).all(), "wrote outside the `out` view"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_batches(paged_batch, seed):
    rng = random.Random(seed)
    hkv = rng.choice([1, 2])
    hq = hkv * rng.choice([1, 2, 4])
    bs = rng.choice([16, 32])
    q_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 4)):
        q_len = rng.choice([1, 1, rng.randint(1, 12)])
        q_lens.append(q_len)
        seq_lens.append(q_len + rng.randint(0, 40))
    dtype = rng.choice([torch.float32, torch.bfloat16])
    batch = paged_batch(q_lens, seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=rng.choice([16, 32]),
                        block_size=bs, dtype=dtype, seed=seed)
    out = paged_attention(*batch.args())
    check_close(out, paged_attention_ref(*batch.args()), dtype)


def test_engine_steps_end_to_end(device):
    """Chunked prefill then decodes, as the engine drives it: write K/V with reshape_and_cache, then attend.

    Two requests over three steps; every query row must equal dense causal SDPA over the full sequence.
    """
    torch.manual_seed(0)
    hq, hkv, d, bs, num_blocks = 4, 2, 16, 16, 8
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_table = torch.tensor([[5, 2, 7], [0, 6, 3]], dtype=torch.int32, device=device)
    lens = [21, 6]
    qs = [torch.randn(n, hq, d, device=device) for n in lens]
    ks = [torch.randn(n, hkv, d, device=device) for n in lens]
    vs = [torch.randn(n, hkv, d, device=device) for n in lens]
    steps = [[(0, 12), (0, 5)], [(12, 20), (5, 6)], [(20, 21), None]]  # per request: token range this step
    got = [torch.empty(n, hq, d, device=device) for n in lens]
    for step in steps:
        reqs = [b for b, r in enumerate(step) if r is not None]
        q = torch.cat([qs[b][slice(*step[b])] for b in reqs])
        k = torch.cat([ks[b][slice(*step[b])] for b in reqs])
        v = torch.cat([vs[b][slice(*step[b])] for b in reqs])
        pos = torch.cat([torch.arange(*step[b], device=device) for b in reqs])
        owner = torch.cat([torch.full((step[b][1] - step[b][0],), b, device=device) for b in reqs])
        slots = block_table[owner, pos // bs].long() * bs + pos % bs
        reshape_and_cache(k, v, k_cache, v_cache, slots)
        q_lens = [step[b][1] - step[b][0] for b in reqs]
        qsl = torch.tensor([0] + q_lens, dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([step[b][1] for b in reqs], dtype=torch.int32, device=device)
        out = paged_attention(q, k_cache, v_cache, block_table[reqs], seq_lens, qsl, d ** -0.5)
        for i, b in enumerate(reqs):
            got[b][slice(*step[b])] = out[qsl[i]:qsl[i + 1]]
    for b in range(2):
        want = dense_causal(qs[b], ks[b], vs[b], d ** -0.5)
        torch.testing.assert_close(got[b], want, atol=2e-5, rtol=2e-5)


def test_validation_errors(paged_batch):
    batch = paged_batch([1], [5], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    q, kc, vc, bt, sl, qsl, scale = batch.args()
    with pytest.raises(ValueError):
        paged_attention(q[:, :3], kc, vc, bt, sl, qsl, scale)  # Hq not a multiple of Hkv
    with pytest.raises(ValueError):
        paged_attention(q, kc, vc, bt, sl, qsl[:-1], scale)  # wrong query_start_loc length
    with pytest.raises(ValueError):
        paged_attention(q, kc, vc, bt, sl, qsl, scale, num_splits=3)


@pytest.mark.parametrize(
    "q_lens,seq_lens,hq,hkv,d,bs,dtype,num_splits,arch",
    [
        ([7, 1, 1], [30, 40, 9], 32, 8, 128, 16, torch.bfloat16, 1, 90),  # mixed prefill + decode, GQA 4
        ([1, 1], [30, 90], 8, 2, 64, 16, torch.float16, 4, 90),  # split-K decode + reduce kernel
        ([3, 1], [20, 33], 12, 4, 256, 32, torch.float32, 1, 80),  # fp32 (ieee dots), D 256, group 3, A100
        ([1], [40], 4, 4, 96, 24, torch.bfloat16, 1, 90),  # odd block size (gather path), padded D
    ],
)
def test_compiles_for_cuda(paged_batch, compile_for_cuda, q_lens, seq_lens, hq, hkv, d, bs, dtype, num_splits, arch):
    """The launch configurations compile to a cubin (the interpreter above never runs the compiler)."""
    pa_mod = importlib.import_module("asyncengine.kernels.paged_attention")  # the module, not the function
    log = compile_for_cuda(pa_mod, arch)
    batch = paged_batch(q_lens, seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                        dtype=dtype, device=torch.device("cpu"))
    pa_mod.paged_attention(*batch.args(), num_splits=num_splits)
    want = ["_paged_attention_kernel"] + (["_split_reduce_kernel"] if num_splits > 1 else [])
    assert [name for name, _ in log] == want


def test_interpreter_scalar_shim(monkeypatch):
    """Triton < 3.7's interpreter converts scalars with int(1-element array), which NumPy >= 2.3
    refuses; the shim in asyncengine.kernels makes __index__ take the one element."""
    import types

    import numpy as np
    from triton.runtime import interpreter

    import asyncengine.kernels as kernels

    class Scope:
        def __init__(self):
            self.attrs = {}

        def set_attr(self, obj, name, value):
            self.attrs[name] = value

    def old_patch(tensor, scope):  # what triton 3.6 does
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", old_patch)
    kernels._fix_interpreter_scalars()
    scope = Scope()
    interpreter._patch_lang_tensor(object, scope)
    scalar = types.SimpleNamespace(handle=types.SimpleNamespace(data=np.array([7], dtype=np.int32)))
    assert scope.attrs["__index__"](scalar) == 7
    kernels._fix_interpreter_scalars()  # idempotent: not wrapped twice
    assert interpreter._patch_lang_tensor._asyncengine_fixed
