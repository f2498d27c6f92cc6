"""Write a step's new K/V into the paged KV cache.

Cache layout (per layer): ``k_cache`` / ``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.
The token of slot ``s`` (``s = block_id * block_size + offset``) lives at
``cache.view(-1, num_kv_heads, head_dim)[s]``. A negative slot means "padding, do not write".
"""

from __future__ import annotations

import torch

from . import _jit, _next_pow2, _require_triton

tl = None  # triton.language, bound by kernels._jit at first launch (importing this module never needs triton)


def _check(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key/value must both be [T, Hkv, D], got {tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, Hkv, D], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} != key's {tuple(key.shape[1:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}")


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Torch reference: ``cache.view(-1, Hkv, D)[slot] = key`` for every slot >= 0 (in place)."""
    _check(key, value, k_cache, v_cache, slot_mapping)
    num_blocks, block_size, hkv, d = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    # Flat views of the caches. Index through (block, offset) so non-contiguous caches work too.
    blk, off = slots // block_size, slots % block_size
    k_cache[blk, off] = key[valid].to(k_cache.dtype)
    v_cache[blk, off] = value[valid].to(v_cache.dtype)


def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (token, tile of BLOCK_H heads).
    t = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_H
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE

    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)

    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kco + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vco + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Triton: write ``key``/``value`` ``[T, Hkv, D]`` into their cache slots (in place; slot < 0 = skip).

    ``key``/``value`` may be strided views (e.g. slices of a fused QKV output); the caches may be any
    strided 4-D views. ``slot_mapping`` is int64 (int32 also accepted) on the same device. No host sync.
    """
    _require_triton("reshape_and_cache")
    _check(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, hkv, d = key.shape
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    block_d = _next_pow2(d)
    # ~2K elements per program: whole token for small models, a few heads per program for big ones.
    block_h = max(1, min(_next_pow2(hkv), 2048 // block_d))
    grid = (num_tokens, -(-hkv // block_h))
    _jit(_reshape_and_cache_kernel)[grid](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        hkv, d,
        BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_D=block_d,
        enable_fp_fusion=True,  # explicit: silences triton 3.9's default-change warning
    )
