"""The 8-bit KV cache behind the cpu and torch backends (``kv_cache_dtype="int8"``): the layout,
the step's metadata and the forward both share.

Layout: per layer, k and v each int8 ``[num_kv_heads, num_blocks, block_size, head_dim + 2]``, a
token's row of one KV head being its int8 values and a float16 scale (kernels/cpu/attention_i8.py).
The block dim is dim 1 as in the 16-bit cache, so the prefix cache, the offload tier and P/D
transfers move blocks (scales included) unchanged. The cpu backend runs the C kernels (int8 read
directly, every chunk length); the torch backend, and the cpu backend where the C library is not
built, quantize in torch and dequantize the blocks each sequence reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.attention.backend import StepBatch
from asyncengine.kernels.cpu import attention as paged
from asyncengine.kernels.cpu import attention_i8


@dataclass
class Int8AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    paged: paged.PagedBatch  # every sequence of the step (decodes and prefill chunks alike)
    num_decodes: int = 0
    prefills: tuple = ()  # none: the int8 path attends every chunk itself
    backend: Any = None


def check(backend) -> None:
    """Refuse where the int8 cache cannot run (the config refuses first; this catches direct use)."""
    if backend.device.type != "cpu":
        from asyncengine.errors import ConfigError  # lazy: only the refusal needs it

        raise ConfigError(f"kv_cache_dtype='int8' runs on CPU only (device {backend.device})")


def kv_cache_shape(backend) -> tuple[int, ...]:
    return attention_i8.cache_shape(backend.num_blocks, backend.block_size, backend.num_kv_heads, backend.head_dim)


def build_metadata(backend, batch: StepBatch) -> Int8AttentionMetadata:
    seqs = [(s.query_start, s.query_len, s.context_len, s.block_ids) for s in batch.seqs]
    return Int8AttentionMetadata(slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.long),
                                 paged=paged.PagedBatch.build(seqs, backend.block_size),
                                 num_decodes=batch.num_decodes, backend=backend)


def forward(backend, q, k, v, kv_cache, meta: Int8AttentionMetadata, sliding_window: int | None,
            softcap: float | None, use_kernel: bool) -> torch.Tensor:
    """Quantize and write the step's K/V, attend every row; [T, Hq * D] in q's dtype."""
    out = torch.empty(q.shape, dtype=q.dtype)
    attention_i8.write_and_attend(q, k, v, kv_cache[0], kv_cache[1], meta.slot_mapping, meta.paged, backend.scale,
                                  out, sliding_window, softcap, use_kernel=use_kernel)
    return out.view(q.shape[0], -1)
