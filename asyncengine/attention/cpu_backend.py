"""The cpu backend: the C paged attention of ``kernels/cpu/attention.c`` (OpenMP over sequences and
KV heads, online softmax, K/V read straight from the block table: no gather copy).

Decodes, speculative rows and prefill chunks up to ``KERNEL_MAX_QUERY_LEN`` tokens go through one
kernel call per layer (the K/V write included); longer chunks keep the torch backend's matmul
path (GEMM-speed scores), which catches up there (docs/benchmarks.md has the measurement). The cache layout is the torch
backend's (``[num_kv_heads, num_blocks, block_size, head_dim]``), so both paths read the same
tensors, and the step's K/V are written through the slot mapping in C too.

Where the kernels are not built (no C compiler, ``ASYNCENGINE_CPU_KERNELS=0``) or do not take the
shapes (dtype, head_dim, block_size), the backend runs the torch backend's code whole: same layout,
same results, slower.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncengine.attention import int8_cache
from asyncengine.attention.backend import AttentionBackend, StepBatch
from asyncengine.attention.torch_backend import TorchBackend
from asyncengine.kernels.cpu import attention as kernel
from asyncengine.layers.attention import PrefillChunk, TorchPagedAttention

log = logging.getLogger(__name__)

# the longest query run (tokens of one sequence in a step) the C kernel attends; longer chunks take
# the torch backend's prefill. Measured (docs/benchmarks.md, "fused CPU decode path"): the kernel
# is faster at every chunk length up to 1,024 and ties at 2,048, with or without cached context.
KERNEL_MAX_QUERY_LEN = 1024


@dataclass
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    paged: kernel.PagedBatch  # the sequences the kernel attends
    prefills: list[PrefillChunk] = field(default_factory=list)  # the rest: torch's prefill path
    num_decodes: int = 0
    backend: Any = None


class CpuBackend(AttentionBackend):
    name = "cpu"
    supports_sliding_window = True
    supports_softcap = True  # the C kernel caps each score (and long prefills the torch path)
    supports_softcap = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.torch_backend = TorchBackend(*args, **kwargs)  # long prefill chunks, and the fallback
        self.kernels = (self.device.type == "cpu" and kernel.available()
                        and kernel.supports(self.dtype, self.head_dim, self.block_size))
        # the C kernel walks each row's keys block by block in position order at any query length
        self.supports_batch_invariant = self.kernels and not self.kv_int8
        if self.kv_int8:
            int8_cache.check(self)
        if not self.kernels:
            log.warning("attention_backend='cpu': the C kernels are unavailable for this engine (%s); "
                        "running the torch backend's attention", self._why_not())

    def _why_not(self) -> str:
        if self.device.type != "cpu":
            return f"device {self.device}"
        if not kernel.available():
            from asyncengine.kernels.cpu import build_error  # lazy: the kernels build/load (C compile, triton) only on this path

            return build_error() or "not built"
        return f"dtype {self.dtype}, head_dim {self.head_dim}, block_size {self.block_size}"

    def kv_cache_shape(self) -> tuple[int, ...]:
        if self.kv_int8:
            return int8_cache.kv_cache_shape(self)
        return TorchPagedAttention.kv_cache_shape(self.num_blocks, self.block_size, self.num_kv_heads,
                                                  self.head_dim)

    def build_metadata(self, batch: StepBatch):
        if self.kv_int8:  # every chunk through the int8 kernel (or its torch fallback)
            return int8_cache.build_metadata(self, batch)
        if not self.kernels:
            return self.torch_backend.build_metadata(batch)  # its metadata routes layers to it
        bs = self.block_size
        short, prefills = [], []
        for s in batch.seqs:
            if s.query_len <= KERNEL_MAX_QUERY_LEN or self.batch_invariant:
                short.append((s.query_start, s.query_len, s.context_len, s.block_ids))
            else:
                nb = -(-s.seq_len // bs)
                prefills.append(PrefillChunk(q_start=s.query_start, q_end=s.query_start + s.query_len,
                                             context_len=s.context_len,
                                             block_ids=torch.tensor(s.block_ids[:nb], dtype=torch.long)))
        return CpuAttentionMetadata(slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.long),
                                    paged=kernel.PagedBatch.build(short, bs), prefills=prefills,
                                    num_decodes=batch.num_decodes, backend=self)

    def forward(self, q, k, v, kv_cache, meta: CpuAttentionMetadata, sliding_window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        if self.kv_int8:
            return int8_cache.forward(self, q, k, v, kv_cache, meta, sliding_window, softcap, use_kernel=self.kernels)
        k_cache, v_cache = kv_cache
        out = torch.empty(q.shape, dtype=q.dtype)
        kernel.write_and_attend(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.paged, self.scale, out,
                                sliding_window, softcap)
        if meta.prefills:
            tb = self.torch_backend
            impl = tb.impl if sliding_window is None and softcap is None else tb._windowed(sliding_window, softcap)
            for ch in meta.prefills:
                a, b = ch.q_start, ch.q_end
                out[a:b] = impl._prefill(q[a:b], k[a:b], v[a:b], k_cache, v_cache, ch)
        return out.view(q.shape[0], -1)
