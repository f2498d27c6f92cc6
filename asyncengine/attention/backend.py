"""The interface every attention backend implements.

A step's batch is flat and unpadded: request ``i`` owns rows ``[query_start, query_start +
query_len)`` and attends, causally, over its ``context_len`` cached tokens plus those rows. A
decode is ``query_len == 1``; a prefill chunk, or a decode carrying several (speculative) tokens,
is the general case ``query_len >= 1`` over any context: backends must not assume more.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SeqChunk:
    """One request's share of the step."""

    query_start: int  # first row in the flat batch
    query_len: int  # new tokens this step (their K/V are written this step)
    context_len: int  # tokens already in the cache before this step
    block_ids: list[int]  # the request's block table (at least enough for context + query)

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass
class StepBatch:
    """What a backend needs to know of a step, built by the runner once per step."""

    seqs: list[SeqChunk]  # in flat-batch order; rows of seqs[i] precede those of seqs[i+1]
    slot_mapping: list[int]  # [num_tokens] cache slot of every new token
    num_decodes: int = 0  # the first num_decodes seqs are single-token decodes (torch groups them)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)

    @property
    def max_query_len(self) -> int:
        return max((s.query_len for s in self.seqs), default=0)


class AttentionBackend(ABC):
    """Owns the KV-cache layout and the attention math of one engine (this rank's heads)."""

    name: str = "abstract"
    supports_sliding_window: bool = False  # layers with a window refuse a backend without (at start)
    supports_softcap: bool = False  # Gemma 2's score soft-cap: forward then gets ``softcap``
    # batch-invariant mode (EngineConfig.batch_invariant): a backend that supports it computes each
    # query row over its keys in one order, whatever the batch, chunking or cache hits; the runner
    # sets batch_invariant after asking
    supports_batch_invariant: bool = False
    batch_invariant: bool = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_blocks: int, dtype: torch.dtype, device: torch.device, scale: float | None = None,
                 max_num_tokens: int = 8192, max_num_seqs: int = 256, max_blocks_per_seq: int | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = device
        self.scale = head_dim ** -0.5 if scale is None else scale
        # the largest step (tokens, sequences, blocks per sequence): for backends that preallocate
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq or num_blocks
        # "int8": the 8-bit cache (kernels/cpu/attention_i8.py: int8 rows + a half scale per token
        # per KV head); "auto": the model's dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_int8 = kv_cache_dtype == "int8"
        self.cache_dtype = torch.int8 if self.kv_int8 else dtype

    @abstractmethod
    def kv_cache_shape(self) -> tuple[int, ...]:
        """Shape of one layer's key (and, separately, value) cache tensor."""

    def allocate_kv_caches(self, num_layers: int, alloc=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One zeroed (k, v) pair per layer (zeroed: 0 probability x NaN would still be NaN)."""
        shape = self.kv_cache_shape()
        if alloc is None:
            def alloc(s, dt, dev):
                return torch.zeros(s, dtype=dt, device=dev)
        return [(alloc(shape, self.cache_dtype, self.device), alloc(shape, self.cache_dtype, self.device))
                for _ in range(num_layers)]

    @abstractmethod
    def build_metadata(self, batch: StepBatch) -> Any:
        """Once per step, before the model runs; every layer shares the result. The result has a
        ``backend`` attribute (self), through which layers call :meth:`forward`."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: Any, sliding_window: int | None = None
                ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (this step's, written to the cache here). Returns [T, Hq*D].
        ``sliding_window``: the layer attends only to its last that many positions (None: all)."""
