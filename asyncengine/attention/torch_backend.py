"""The torch backend: :class:`asyncengine.layers.attention.TorchPagedAttention` (the CPU path)
behind the seam, unchanged: head-major cache, decode groups, prefill chunks in query blocks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.attention import int8_cache
from asyncengine.attention.backend import AttentionBackend, StepBatch
from asyncengine.layers.attention import (AttentionMetadata, PrefillChunk, TorchPagedAttention,
                                          build_decode_groups)


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    backend: Any = None


class TorchBackend(AttentionBackend):
    name = "torch"
    supports_sliding_window = True
    supports_softcap = True
    supports_softcap = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.impl = TorchPagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.scale)
        self._by_window: dict[tuple[int | None, float | None], TorchPagedAttention] = {}
        # scratch for the decode attention's gathered keys, reused by every layer and step
        self.workspace = torch.empty(0, dtype=self.dtype, device=self.device)
        if self.kv_int8:
            int8_cache.check(self)

    def kv_cache_shape(self) -> tuple[int, ...]:
        if self.kv_int8:  # int8 rows + scales; this backend dequantizes the blocks it reads
            return int8_cache.kv_cache_shape(self)
        return TorchPagedAttention.kv_cache_shape(self.num_blocks, self.block_size, self.num_kv_heads,
                                                  self.head_dim)

    def build_metadata(self, batch: StepBatch) -> TorchAttentionMetadata:
        if self.kv_int8:
            return int8_cache.build_metadata(self, batch)
        dev = self.device
        nd = batch.num_decodes
        meta = TorchAttentionMetadata(
            slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.long, device=dev),
            num_decodes=nd, backend=self)
        if nd:
            decodes = batch.seqs[:nd]
            meta.decode_groups = build_decode_groups(
                [s.block_ids for s in decodes], [s.seq_len for s in decodes], self.block_size,
                self.num_kv_heads, self.num_heads // self.num_kv_heads, self.num_blocks, dev)
            meta.workspace = self._workspace(meta.decode_groups)
        bs = self.block_size
        for s in batch.seqs[nd:]:
            nb = -(-s.seq_len // bs)
            meta.prefills.append(PrefillChunk(
                q_start=s.query_start, q_end=s.query_start + s.query_len, context_len=s.context_len,
                block_ids=torch.tensor(s.block_ids[:nb], dtype=torch.long, device=dev)))
        return meta

    def _workspace(self, groups) -> torch.Tensor:
        """The decode scratch, grown (never shrunk) to hold the largest group's gathered keys."""
        need = max(self.num_kv_heads * (g.end - g.start) * g.num_blocks * self.block_size * self.head_dim
                   for g in groups)
        if self.workspace.numel() < need:
            self.workspace = torch.empty(need, dtype=self.dtype, device=self.device)
        return self.workspace

    def forward(self, q, k, v, kv_cache, meta, sliding_window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        if self.kv_int8:
            return int8_cache.forward(self, q, k, v, kv_cache, meta, sliding_window, softcap, use_kernel=False)
        impl = self.impl if sliding_window is None and softcap is None else self._windowed(sliding_window, softcap)
        return impl.forward(q, k, v, kv_cache, meta)

    def _windowed(self, window: int | None, softcap: float | None = None) -> TorchPagedAttention:
        """The same attention limited to the last ``window`` positions (Mistral, Qwen2's sliding
        layers) and/or soft-capped (Gemma 2), one per distinct (window, cap)."""
        impl = self._by_window.get((window, softcap))
        if impl is None:
            impl = self._by_window[(window, softcap)] = TorchPagedAttention(
                self.num_heads, self.num_kv_heads, self.head_dim, self.scale, sliding_window=window,
                softcap=softcap)
        return impl
