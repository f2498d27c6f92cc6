"""The 8-bit KV cache (``attention_i8.c``): keys and values quantized as they are written, one
symmetric scale per token per KV head (llama.cpp's q8_0 rule over a head's row), and paged
attention that reads the int8 rows straight from the block table.

Cache layout (one layer): k and v each int8 ``[num_kv_heads, num_blocks, block_size, head_dim + 2]``:
a row is ``head_dim`` int8 values then its scale as a float16 (``max|x| / 127``). The torch
functions here are the same computation: the fallback where the library is not built (they
dequantize the blocks a sequence reads), and the tests' reference.
"""
from __future__ import annotations

import ctypes

import torch

from asyncengine.kernels.cpu.attention import PARALLEL_MIN_WORK, PagedBatch, attend_reference, supports
from asyncengine.kernels.cpu.build import LazyBinding

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "ae_attn_i8_write_kv": [_P, _L, _P, _L, _P, _P, _P, _I, _I, _I, _L, _I, _I],
    "ae_attn_i8_paged": [_P, _L, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _F, _I, _I],
    "ae_attn_i8_write_and_attend": [_P, _L, _P, _L, _P, _I, _P, _L, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I,
                                    _I, _I, _I, _F, _I, _F, _I, _I],
    "ae_attn_i8_set_fast": [_I],
}
SCALE_BYTES = 2  # the float16 scale after each row's values

_lib = LazyBinding(_SIGNATURES)
available = _lib.available
_reset_for_tests = _lib.reset


def set_fast(on: bool) -> None:
    """Whether the AVX-512 VNNI loop runs where it applies (head dims % 64, block sizes % 16): it
    rounds each query row to int8 for the QK dot products (llama.cpp's method with a q8_0 K cache);
    off, the fp32 loops run there too (the tests hold the two to each other and to torch)."""
    fns = _lib()
    if fns:
        fns["ae_attn_i8_set_fast"](int(on))


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """One layer's key (and, separately, value) cache: int8 rows of values + scale."""
    return (num_kv_heads, num_blocks, block_size, head_dim + SCALE_BYTES)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (fp32/bf16) -> int8 [..., D + 2]: the kernel's bits (round half to even, the
    scale max|x| / 127 rounded to float16)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv).clamp_(-127, 127).to(torch.int8)
    scale = (amax / torch.full_like(amax, 127.0)).to(torch.float16)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 [..., D + 2] -> fp32 [..., D]."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float16).float()
    return rows[..., :d].float() * scale


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    hk, _, _, rs = k_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    k_cache.view(hk, -1, rs).index_copy_(1, slot_mapping, quantize_rows(k).transpose(0, 1))
    v_cache.view(hk, -1, rs).index_copy_(1, slot_mapping, quantize_rows(v).transpose(0, 1))


def _rounded_scores(qs: torch.Tensor, k_rows: torch.Tensor) -> torch.Tensor:
    """The VNNI loop's scores (attention_i8_avx512.c): each scaled query row rounded to int8 with
    its own scale, integer dot products (exact in fp32 at these sizes), times both scales."""
    amax = qs.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q8 = torch.round(qs * inv)
    d = k_rows.shape[-1] - SCALE_BYTES
    k8 = k_rows[..., :d].float().unsqueeze(1)  # [Hkv, 1, L, D]
    kscale = k_rows[..., d:].contiguous().view(torch.float16).float().transpose(-1, -2).unsqueeze(1)  # [Hkv, 1, 1, L]
    return torch.matmul(q8, k8.transpose(-1, -2)) * (amax / torch.full_like(amax, 127.0)) * kscale


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                          scale: float, out: torch.Tensor, sliding_window: int | None = None,
                          softcap: float | None = None, round_queries: bool = False) -> None:
    """The attention of :func:`write_and_attend` in torch: each sequence's blocks gathered and
    dequantized, then attended in fp32 (causal, windowed, soft-capped). ``round_queries``: the
    scores as the AVX-512 VNNI loop computes them (:func:`_rounded_scores`)."""
    hk, _, _, rs = k_cache.shape
    d = rs - SCALE_BYTES
    hq = q.shape[1]
    g = hq // hk
    starts = batch.block_starts.tolist()
    ids = batch.block_ids.long()
    for s in range(batch.num_seqs):
        q0, n, ctx = int(batch.query_starts[s]), int(batch.query_lens[s]), int(batch.context_lens[s])
        total = ctx + n
        blocks = ids[starts[s]:starts[s + 1]]
        k_rows = k_cache[:, blocks].reshape(hk, -1, rs)[:, :total]
        vals = dequantize_rows(v_cache[:, blocks].reshape(hk, -1, rs)[:, :total])
        qs = q[q0:q0 + n].float().view(n, hk, g, d).permute(1, 2, 0, 3) * scale  # [Hkv, g, n, D]
        if round_queries:
            scores = _rounded_scores(qs, k_rows)
        else:
            scores = torch.matmul(qs, dequantize_rows(k_rows).unsqueeze(1).transpose(-1, -2))  # [Hkv, g, n, L]
        out[q0:q0 + n] = attend_reference(scores, vals, ctx, softcap, sliding_window).to(out.dtype)


def _c_ok(q, k, v, k_cache, v_cache, slot_mapping, out) -> bool:
    hk, _, bs, rs = k_cache.shape
    d = rs - SCALE_BYTES
    dt = q.dtype
    return (q.device.type == "cpu" and k.dtype == dt and v.dtype == dt and out.dtype == dt
            and k_cache.dtype == torch.int8 and v_cache.dtype == torch.int8 and supports(dt, d, bs)
            and q.stride(2) == 1 and q.stride(1) == d and k.dim() == 3 and k.shape == v.shape
            and k.stride(2) == 1 and k.stride(1) == d and v.stride(2) == 1 and v.stride(1) == d
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and out.is_contiguous()
            and k_cache.is_contiguous() and v_cache.is_contiguous() and q.shape[1] % hk == 0)


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, batch: PagedBatch, scale: float,
                     out: torch.Tensor, sliding_window: int | None = None, softcap: float | None = None,
                     use_kernel: bool = True, round_queries: bool = False) -> None:
    """Quantize k, v ([T, Hkv, D]) into their slots (int64 [T]; < 0: skip), then attend the rows of
    ``batch`` (q [T, Hq, D]) into the same rows of ``out``; one C call where the library is built
    and takes the shapes, else the torch functions above (also with ``use_kernel=False``;
    ``round_queries`` then rounds the queries as the VNNI loop does, for the tests)."""
    fns = _lib() if use_kernel else False
    if not (fns and _c_ok(q, k, v, k_cache, v_cache, slot_mapping, out)):
        write_kv_torch(k, v, k_cache, v_cache, slot_mapping)
        paged_attention_torch(q, k_cache, v_cache, batch, scale, out, sliding_window, softcap, round_queries)
        return
    hk, nb, bs, rs = k_cache.shape
    d, hq = rs - SCALE_BYTES, q.shape[1]
    fns["ae_attn_i8_write_and_attend"](
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(), k.shape[0],
        q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        batch.block_ids.data_ptr(), batch.block_starts.data_ptr(), batch.query_starts.data_ptr(),
        batch.query_lens.data_ptr(), batch.context_lens.data_ptr(), batch.num_seqs, hq, hk, d, nb, bs, scale,
        sliding_window or 0, softcap or 0.0, int(q.dtype == torch.bfloat16),
        int(batch.work * hq * d >= PARALLEL_MIN_WORK))
