"""Varlen paged attention over the KV cache: prefill chunks and decodes of one step in one launch.

Inputs (one layer):

* ``q``: ``[T, Hq, D]``, the step's query tokens of all requests, packed (request ``b`` owns rows
  ``query_start_loc[b]:query_start_loc[b+1]``). May be a strided view.
* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, Hkv, D]``; this step's K/V are already written
  (``reshape_and_cache`` runs first).
* ``block_table``: ``[B, max_blocks]`` int32, physical block ids of each request's logical blocks.
* ``seq_lens``: ``[B]`` int32, context length of each request INCLUDING this step's tokens.
* ``query_start_loc``: ``[B+1]`` int32, cumulative query lengths (``[0, q0, q0+q1, ...]``).

Query token ``i`` of request ``b`` (``q_len = qsl[b+1] - qsl[b]``) sits at position
``seq_lens[b] - q_len + i`` and attends to key positions ``<= `` its own. GQA: ``Hq = Hkv * group``,
query head ``h`` reads kv head ``h // group``. Rows of ``q`` past ``query_start_loc[B]`` (graph padding)
get no defined output.
"""

from __future__ import annotations

import torch

from . import _jit, _next_pow2, _require_triton, triton_interpret

tl = None  # triton.language, bound by kernels._jit at first launch (importing this module never needs triton)

_LOG2E = 1.4426950408889634

# Kernel-writing notes (all kernels of this package):
# * Row max / sum are written `tl.reduce(x, axis, tl.standard._elementwise_max / _sum_combine)`, not
#   `tl.max` / `tl.sum` (same code on the GPU). triton's standard-library helpers (tl.max, tl.sum,
#   tl.cdiv, tl.zeros, ...) are themselves @jit functions, decorated when triton is first imported; if
#   that happened without TRITON_INTERPRET=1 (e.g. `import transformers` pulls in torch._dynamo, which
#   imports triton), the CPU interpreter cannot call them later. tl.reduce is a builtin, and the
#   interpreter recognises these two combine functions by identity and reduces with numpy.
# * For the same reason: tl.full instead of tl.zeros, integer ceil-division instead of tl.cdiv, and no
#   helper @jit functions of our own.


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, Hkv, D], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"head_dim mismatch: q has {d}, cache has {k_cache.shape[3]}")
    if hq % hkv != 0:
        raise ValueError(f"num query heads {hq} is not a multiple of num kv heads {hkv}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [B, max_blocks], got {tuple(block_table.shape)}")
    b = block_table.shape[0]
    if seq_lens.shape != (b,) or query_start_loc.shape != (b + 1,):
        raise ValueError(f"expected seq_lens [{b}] and query_start_loc [{b + 1}], "
                         f"got {tuple(seq_lens.shape)} and {tuple(query_start_loc.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 (or int64), got {t.dtype}")


# --------------------------------------------------------------------------------------------
# Torch reference
# --------------------------------------------------------------------------------------------


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch reference of :func:`paged_attention` (loops over requests; syncs to the host)."""
    _check(q, k_cache, v_cache, block_table, seq_lens, query_start_loc)
    t, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(block_table.shape[0]):
        q0, q1 = qsl[b], qsl[b + 1]
        q_len, seq_len = q1 - q0, lens[b]
        if q_len == 0:
            continue
        n_blocks = -(-seq_len // block_size)
        blocks = block_table[b, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:seq_len].float()  # [S, Hkv, D]
        v = v_cache[blocks].reshape(-1, hkv, d)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qb = q[q0:q1].float().transpose(0, 1)  # [Hq, q_len, D]
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # [Hq, q_len, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]  # [q_len, S]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out


# --------------------------------------------------------------------------------------------
# Triton kernels (plain functions, handed to triton.jit on first launch: see kernels._jit)
# --------------------------------------------------------------------------------------------


def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    ws_acc_ptr, ws_m_ptr, ws_l_ptr,
    block_table_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, num_seqs, head_dim,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    TILE_IN_ONE_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # Program = (q block, kv head, split). A q block holds BLOCK_Q consecutive query tokens of ONE
    # request times the GROUP query heads sharing this kv head: BLOCK_M rows, row r = (token r // GROUP,
    # head r % GROUP), so every K/V tile loaded is used by the whole GQA group.
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # q blocks are numbered so that request b's first block is qsl[b] // BLOCK_Q + b (an upper bound
    # that needs no host sync); binary-search the request that owns block qb.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start_mid = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        go_right = start_mid <= qb
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo - 1

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_blk = qb - (q_start // BLOCK_Q + seq)
    if q_blk * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - q_len  # position of the request's first query token

    offs_m = tl.arange(0, BLOCK_M)
    tok = q_blk * BLOCK_Q + offs_m // GROUP  # token index within the request
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    pos = ctx_start + tok
    q_row = (q_start + tok).to(tl.int64)

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < head_dim
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST_DOT:  # triton's CPU interpreter multiplies bf16 bit patterns as integers: dot in fp32 there
        q = q.to(tl.float32)

    # Keys this block needs: up to the last query token's position (causal), inclusive.
    kv_end = ctx_start + tl.minimum((q_blk + 1) * BLOCK_Q, q_len)
    num_tiles = (kv_end + TILE_N - 1) // TILE_N
    tiles_per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    # Finite "minus infinity" for the running max: fully masked rows/tiles then give
    # exp2(-inf - m) = 0 and alpha = exp2(0) = 1, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, dtype=tl.float32)

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh * stride_kch
    v_head = v_cache_ptr + kvh * stride_vch
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        n_ok = offs_n < kv_end
        if TILE_IN_ONE_BLOCK:
            phys = tl.load(bt_row + (tile * TILE_N) // BLOCK_SIZE).to(tl.int64)
            k_off = phys * stride_kcb + (offs_n % BLOCK_SIZE) * stride_kco
            v_off = phys * stride_vcb + (offs_n % BLOCK_SIZE) * stride_vco
        else:
            phys = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            k_off = phys * stride_kcb + (offs_n % BLOCK_SIZE) * stride_kco
            v_off = phys * stride_vcb + (offs_n % BLOCK_SIZE) * stride_vco
        # K^T tile [D, N] and V tile [N, D], in q's dtype (the cache may be stored in another one).
        k = tl.load(k_head + k_off[None, :] + offs_d[:, None] * stride_kcd,
                    mask=d_ok[:, None] & n_ok[None, :], other=0.0).to(q_ptr.dtype.element_ty)
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :] * stride_vcd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(q_ptr.dtype.element_ty)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [M, N] fp32, log2 domain
        allowed = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))

        # Online softmax (row max / sum through tl.reduce: see the notes at the top of the module).
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        p = p.to(q_ptr.dtype.element_ty)  # P @ V on the tensor cores in the input dtype, fp32 accumulate
        if UPCAST_DOT:
            p = p.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Workspace rows: [T, Hq, NUM_SPLITS] (+ [HEAD_DIM_PAD] for acc), contiguous.
        ws_row = (q_row * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(ws_m_ptr + ws_row, m_i, mask=row_ok)
        tl.store(ws_l_ptr + ws_row, l_i, mask=row_ok)
        tl.store(ws_acc_ptr + ws_row[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


def _split_reduce_kernel(
    out_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr, qsl_ptr,
    num_seqs, num_q_heads, head_dim,
    stride_ot, stride_oh, stride_od,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    # One program per (token, query head): merge the splits' partial softmax states.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if t >= tl.load(qsl_ptr + num_seqs):  # padding rows past the last request: leave `out` untouched
        return
    row = t * num_q_heads + h
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m = tl.load(ws_m_ptr + row * NUM_SPLITS + offs_s)
    l = tl.load(ws_l_ptr + row * NUM_SPLITS + offs_s)
    acc = tl.load(ws_acc_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    m_max = tl.reduce(m, 0, tl.standard._elementwise_max)
    w = tl.math.exp2(m - m_max)
    denom = tl.reduce(w * l, 0, tl.standard._sum_combine)
    denom = tl.where(denom == 0.0, 1.0, denom)
    o = tl.reduce(acc * w[:, None], 0, tl.standard._sum_combine) / denom
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------

_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _pow2_divisor(n: int) -> int:
    return n & -n


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None, *, num_splits: int | None = None,
                    max_query_len: int | None = None) -> torch.Tensor:
    """Triton varlen paged attention (mixed prefill chunks + decodes in one launch); returns ``[T, Hq, D]``.

    No host sync: launch sizes come from tensor shapes (and the optional host ints below) only, so it is
    CUDA-graph friendly for fixed shapes. Only rows ``< query_start_loc[B]`` of ``out`` are written.

    Keyword-only tuning knobs (never needed for correctness):

    * ``max_query_len``: the scheduler's host-side max q_len of the batch. ``1`` selects the decode
      configuration (small q tiles, split-K). Default: guessed from shapes (decode iff ``T == B``).
    * ``num_splits``: split each request's keys over this many programs and merge the partial softmax
      states (flash-decoding); a power of two. Default: 1, except decode batches on CUDA whose
      ``B * Hkv`` programs would leave SMs idle.
    """
    _require_triton("paged_attention")
    _check(q, k_cache, v_cache, block_table, seq_lens, query_start_loc)
    t, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    num_seqs = block_table.shape[0]
    group = hq // hkv
    if out is None:
        out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape:
        raise ValueError(f"out must be {tuple(q.shape)}, got {tuple(out.shape)}")
    if t == 0 or num_seqs == 0:
        return out

    head_dim_pad = max(16, _next_pow2(d))
    group_pad = _next_pow2(group)
    # Decode batch (every q_len == 1)? Only picks tile sizes; correctness never depends on it.
    decode_only = max_query_len == 1 if max_query_len is not None else t == num_seqs
    if decode_only:
        block_m = max(16, group_pad)
    else:
        block_m = max(64 if head_dim_pad <= 128 else 32, group_pad)
    block_q = block_m // group
    tile_n = 64 if head_dim_pad <= 64 else (32 if head_dim_pad <= 128 else 16)
    if decode_only:
        tile_n = min(tile_n, 32)
    pow2_bs = _pow2_divisor(block_size)
    if pow2_bs >= 16:
        tile_n = min(tile_n, pow2_bs)
        tile_in_one_block = True
    else:  # odd block size: gather the block id of every key
        tile_in_one_block = False

    num_q_blocks = t // block_q + num_seqs  # upper bound; programs past their request's end exit at once

    if num_splits is None:
        num_splits = 1
        if decode_only and q.is_cuda:
            programs = num_q_blocks * hkv
            max_ctx = block_table.shape[1] * block_size
            want = max(1, (2 * _sm_count(q.device)) // max(1, programs))
            want = min(want, max(1, max_ctx // (4 * tile_n)), 32)
            num_splits = 1 << (want.bit_length() - 1)  # round down to a power of two
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")

    if num_splits > 1:
        ws_acc = torch.empty(t, hq, num_splits, head_dim_pad, dtype=torch.float32, device=q.device)
        ws_m = torch.empty(t, hq, num_splits, dtype=torch.float32, device=q.device)
        ws_l = torch.empty(t, hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        ws_acc = ws_m = ws_l = out  # unused

    num_warps = 4 if block_m * head_dim_pad <= 64 * 64 else 8
    _jit(_paged_attention_kernel)[(num_q_blocks, hkv, num_splits)](
        q, k_cache, v_cache, out,
        ws_acc, ws_m, ws_l,
        block_table, seq_lens, query_start_loc,
        float(scale) * _LOG2E, num_seqs, d,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        block_table.stride(0),
        GROUP=group, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits, TILE_IN_ONE_BLOCK=tile_in_one_block,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=q.dtype == torch.bfloat16 and triton_interpret(),
        num_warps=num_warps, enable_fp_fusion=True,
    )
    if num_splits > 1:
        _jit(_split_reduce_kernel)[(t, hq)](
            out, ws_acc, ws_m, ws_l, query_start_loc, num_seqs, hq, d, *out.stride(),
            NUM_SPLITS=num_splits, HEAD_DIM_PAD=head_dim_pad, num_warps=4, enable_fp_fusion=True,
        )
    return out

