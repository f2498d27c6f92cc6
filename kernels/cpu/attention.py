"""The paged attention of ``attention.c``: the step's K/V written through the slot mapping, and the
query rows of many sequences attended straight from the paged cache (no gather copy).

Cache layout (one layer): k and v each ``[num_kv_heads, num_blocks, block_size, head_dim]``, float32
or bfloat16. Sequences are described once per step by a :class:`PagedBatch` (CSR block tables and
per-sequence row ranges, int32), shared by every layer. :func:`paged_attention_torch` is the same
computation in torch: the fallback where the library is not built, and the tests' reference.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from asyncengine.kernels.cpu.build import LazyBinding

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "ae_attn_paged": [_P, _L, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _F, _I, _I],
    "ae_attn_write_kv": [_P, _L, _P, _L, _P, _P, _P, _I, _I, _I, _L, _I, _I],
    "ae_attn_write_and_attend": [_P, _L, _P, _L, _P, _I, _P, _L, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I,
                                 _I, _I, _F, _I, _F, _I, _I],
    "ae_attn_set_split": [_I],
}
MAX_HEAD_DIM = 512  # the kernel's per-thread buffers (attention.c AE_ATTN_MAX_D)
MAX_BLOCK_SIZE = 256
# query rows x keys x head_dim a step must reach before the kernel splits its items over the
# OpenMP threads (below it, waking them costs more than the work)
PARALLEL_MIN_WORK = 1 << 17

_lib = LazyBinding(_SIGNATURES)  # the bound functions, or False where the library is not built
available = _lib.available
_reset_for_tests = _lib.reset


def set_split(keys: int) -> None:
    """Split a decoding sequence's keys over threads in runs of ``keys`` (partials merged in key
    order; the choice depends on the sequence alone, so batch invariant); 0 or -1 = never (the
    default: measured slower on our 2-core machine, kernels/cpu/attention.c says by how much)."""
    if keys < -1:
        raise ValueError(f"split keys must be -1, 0 or positive, got {keys}")
    fns = _lib()
    if fns:
        fns["ae_attn_set_split"](keys)


def supports(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether the kernel takes this cache (else the caller keeps its torch path)."""
    return dtype in (torch.float32, torch.bfloat16) and 0 < head_dim <= MAX_HEAD_DIM and 0 < block_size <= MAX_BLOCK_SIZE


@dataclass
class PagedBatch:
    """The sequences one kernel call attends, built once per step (int32 tensors on CPU)."""

    block_ids: torch.Tensor  # every sequence's block table, concatenated
    block_starts: torch.Tensor  # [n + 1] offsets into block_ids
    query_starts: torch.Tensor  # [n] first row of each sequence in the step's q
    query_lens: torch.Tensor  # [n]
    context_lens: torch.Tensor  # [n] tokens cached before this step's rows
    work: int  # sum of rows x keys, to decide serial or parallel (times heads and head_dim)
    num_seqs: int

    @classmethod
    def build(cls, seqs, block_size: int) -> "PagedBatch":
        """``seqs``: (query_start, query_len, context_len, block_ids) of each sequence."""
        ids: list[int] = []
        starts = [0]
        qs, ql, cl = [], [], []
        work = 0
        for q0, n, ctx, blocks in seqs:
            nb = -(-(ctx + n) // block_size)
            ids.extend(blocks[:nb])
            starts.append(len(ids))
            qs.append(q0)
            ql.append(n)
            cl.append(ctx)
            work += n * (ctx + n)
        n, m = len(qs), len(ids)
        flat = torch.tensor(ids + starts + qs + ql + cl, dtype=torch.int32)  # one tensor, five views
        return cls(flat[:m], flat[m:m + n + 1], flat[m + n + 1:m + 2 * n + 1], flat[m + 2 * n + 1:m + 3 * n + 1],
                   flat[m + 3 * n + 1:], work, n)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v ([T, Hkv, D], tokens any stride) into their slots (int64 [T]; < 0: skip)."""
    fns = _lib()
    hk, nb, bs, d = k_cache.shape
    ok = (fns and k.dtype == k_cache.dtype == v.dtype == v_cache.dtype and k.device.type == "cpu"
          and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and k_cache.is_contiguous()
          and v_cache.is_contiguous() and k.dim() == 3 and k.shape == v.shape and k.stride(2) == 1
          and k.stride(1) == d and v.stride(2) == 1 and v.stride(1) == d)
    if not ok:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
        k_cache.view(hk, -1, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
        v_cache.view(hk, -1, d).index_copy_(1, slot_mapping, v.transpose(0, 1))
        return
    fns["ae_attn_write_kv"](k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                            v_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], hk, d, nb, bs, k.element_size())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                    scale: float, out: torch.Tensor, sliding_window: int | None = None,
                    softcap: float | None = None) -> None:
    """Attend the rows of ``batch``'s sequences: q [T, Hq, D] (tokens any stride), written into the
    same rows of ``out`` ([T, Hq, D], contiguous); other rows of out are left alone. The step's own
    keys must already be in the cache (:func:`write_kv`). ``softcap`` (Gemma 2): scaled scores
    -> ``softcap * tanh(s / softcap)`` before the softmax."""
    fns = _lib()
    hk, nb, bs, d = k_cache.shape
    hq = q.shape[1]
    ok = (fns and q.dtype == k_cache.dtype == v_cache.dtype == out.dtype and supports(q.dtype, d, bs)
          and q.stride(2) == 1 and q.stride(1) == d and out.is_contiguous() and k_cache.is_contiguous()
          and v_cache.is_contiguous() and hq % hk == 0)
    if not ok:
        paged_attention_torch(q, k_cache, v_cache, batch, scale, out, sliding_window, softcap)
        return
    if batch.num_seqs == 0:
        return
    fns["ae_attn_paged"](q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                         batch.block_ids.data_ptr(), batch.block_starts.data_ptr(), batch.query_starts.data_ptr(),
                         batch.query_lens.data_ptr(), batch.context_lens.data_ptr(), batch.num_seqs, hq, hk, d, nb,
                         bs, scale, sliding_window or 0, softcap or 0.0, int(q.dtype == torch.bfloat16),
                         int(batch.work * hq * d >= PARALLEL_MIN_WORK))


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, batch: PagedBatch, scale: float,
                     out: torch.Tensor, sliding_window: int | None = None, softcap: float | None = None) -> None:
    """:func:`write_kv` then :func:`paged_attention`, in one C call where both apply (a layer's
    attention costs one crossing into C)."""
    fns = _lib()
    hk, nb, bs, d = k_cache.shape
    hq = q.shape[1]
    dt = q.dtype
    ok = (fns and k.dtype == dt and v.dtype == dt and k_cache.dtype == dt and v_cache.dtype == dt
          and out.dtype == dt and supports(dt, d, bs) and q.stride(2) == 1 and q.stride(1) == d
          and k.dim() == 3 and k.shape == v.shape and k.stride(2) == 1 and k.stride(1) == d and v.stride(2) == 1
          and v.stride(1) == d and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
          and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous() and hq % hk == 0)
    if not ok:
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        paged_attention(q, k_cache, v_cache, batch, scale, out, sliding_window, softcap)
        return
    fns["ae_attn_write_and_attend"](
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(), k.shape[0],
        q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        batch.block_ids.data_ptr(), batch.block_starts.data_ptr(), batch.query_starts.data_ptr(),
        batch.query_lens.data_ptr(), batch.context_lens.data_ptr(), batch.num_seqs, hq, hk, d, nb, bs, scale,
        sliding_window or 0, softcap or 0.0, int(dt == torch.bfloat16), int(batch.work * hq * d >= PARALLEL_MIN_WORK))


def attend_reference(scores: torch.Tensor, vals: torch.Tensor, ctx: int, softcap: float | None,
                     sliding_window: int | None) -> torch.Tensor:
    """The references' shared tail: scaled scores [Hkv, g, n, L] of a chunk of n queries after ``ctx``
    cached tokens, capped, masked (causal, window), softmaxed and applied to the values [Hkv, L, D];
    returns [n, Hkv * g, D] in fp32."""
    hk, g, n, total = scores.shape
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(ctx, total).view(n, 1)
    key = torch.arange(total).view(1, total)
    hidden = key > pos
    if sliding_window is not None:
        hidden |= key <= pos - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    o = torch.matmul(scores.softmax(-1), vals.unsqueeze(1))  # [Hkv, g, n, D]
    return o.permute(2, 0, 1, 3).reshape(n, hk * g, vals.shape[-1])


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                          scale: float, out: torch.Tensor, sliding_window: int | None = None,
                          softcap: float | None = None) -> None:
    """The same attention, one sequence at a time: gather its blocks, (soft-cap,) mask, softmax in fp32."""
    hk, nb, bs, d = k_cache.shape
    hq = q.shape[1]
    g = hq // hk
    starts = batch.block_starts.tolist()
    ids = batch.block_ids.long()
    for s in range(batch.num_seqs):
        q0, n, ctx = int(batch.query_starts[s]), int(batch.query_lens[s]), int(batch.context_lens[s])
        total = ctx + n
        blocks = ids[starts[s]:starts[s + 1]]
        keys = k_cache[:, blocks].reshape(hk, -1, d)[:, :total].float()  # [Hkv, L, D]
        vals = v_cache[:, blocks].reshape(hk, -1, d)[:, :total].float()
        qs = q[q0:q0 + n].float().view(n, hk, g, d).permute(1, 2, 0, 3)  # [Hkv, g, n, D]
        scores = torch.matmul(qs, keys.unsqueeze(1).transpose(-1, -2)) * scale  # [Hkv, g, n, L]
        out[q0:q0 + n] = attend_reference(scores, vals, ctx, softcap, sliding_window).to(out.dtype)
