"""The KV-cache tensors of one rank: what a block costs in bytes (the sizing the core decides on),
and a zeroed allocation that costs no memory until a block is written (the target's cache and the
draft model's alike)."""
from __future__ import annotations

import math
import mmap

import torch


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype, num_layers: int | None = None,
                       kv_cache_dtype: str = "auto") -> int:
    """Bytes one KV block takes on this rank (its share of the KV heads, its pipeline stage's
    layers; core/kv_sizing.py). ``num_layers``: the cache tensors a block spans, when not every
    layer's (per-group tables: one group's, worker/kv_groups.py). ``kv_cache_dtype="int8"``: a row
    is head_dim int8 values and a 2-byte scale (attention/int8_cache.py), about half a bf16 row."""
    from asyncengine.contracts.kv_sizing import KVModelShape, bytes_per_block  # lazy: only when the cache is sized or allocated

    a = model.args
    layers = num_layers or len(model.layers)
    if kv_cache_dtype == "int8":
        from asyncengine.kernels.cpu.attention_i8 import SCALE_BYTES  # lazy: only for the int8 cache

        shape = KVModelShape(layers, model.num_kv_heads, a.head_dim + SCALE_BYTES, max_model_len=0)
        return bytes_per_block(shape, block_size, 1)
    shape = KVModelShape(layers, model.num_kv_heads, a.head_dim, max_model_len=0)
    return bytes_per_block(shape, block_size, dtype.itemsize)


def kv_cache_zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV-cache tensor whose memory is not touched until used.

    Zeroed, not empty: masked-out slots are multiplied by 0 probabilities, and 0 * NaN = NaN. On CPU
    the zeros come from the kernel: fresh anonymous memory reads as zero and each page becomes
    resident only when first written, so a cache sized for many long sequences costs a one-line
    chat only the pages its few blocks use (zeroing 2 GiB up front took 6.7 s and 2 GiB of RSS).
    No huge-page advice (it made decode gathers ~15% faster): the head-major layout spreads a block
    over every head's region, and each first write would fault in 2 MiB where it needs 4 KiB."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps the mapping alive
