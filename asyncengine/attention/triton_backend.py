"""The Triton backend (CUDA; also runs on CPU in triton's interpreter, ``TRITON_INTERPRET=1``).

Cache per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for k and v (the layout of
``asyncengine.kernels``). Per layer, two launches: ``reshape_and_cache`` writes the step's K/V
through the slot mapping, then ``paged_attention`` attends every request of the step, prefill
chunks and decodes alike, in one varlen launch over the block tables (causal inside a chunk, full
over the cached context, GQA/MQA by head groups, split-K for long decodes with few sequences).

The step's metadata lives in :class:`PersistentBuffers` (pinned host + device, fixed addresses),
so a step allocates nothing on the device and a decode batch can be padded to a captured CUDA
graph's size: padding sequences have no query rows (``query_start_loc`` repeats) and padding
tokens slot -1 (not written).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.attention.backend import AttentionBackend, StepBatch
from asyncengine.attention.buffers import PersistentBuffers


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, context + this step's tokens
    query_start_loc: torch.Tensor  # [B+1] int32
    max_query_len: int
    num_decodes: int = 0
    backend: Any = None


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.kv_int8:
            from asyncengine.errors import ConfigError  # lazy: only the refusal needs it

            raise ConfigError("kv_cache_dtype='int8': the triton attention backend reads only a 16-bit cache")
        from asyncengine.kernels import paged_attention, reshape_and_cache, triton_available  # lazy: the kernels build/load (C compile, triton) only on this path

        if not triton_available():
            raise RuntimeError("the triton attention backend needs triton and either a CUDA device "
                               "or TRITON_INTERPRET=1 (its CPU interpreter, for tests)")
        self._paged_attention = paged_attention
        self._reshape_and_cache = reshape_and_cache
        seqs = self.max_num_seqs
        self.buffers = PersistentBuffers({
            "slot_mapping": ((self.max_num_tokens,), torch.int64),
            "block_table": ((seqs, self.max_blocks_per_seq), torch.int32),
            "seq_lens": ((seqs,), torch.int32),
            "query_start_loc": ((seqs + 1,), torch.int32),
        }, self.device)

    def kv_cache_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def build_metadata(self, batch: StepBatch, pad_tokens: int | None = None,
                       pad_seqs: int | None = None) -> TritonAttentionMetadata:
        """``pad_tokens`` / ``pad_seqs``: sizes to pad to (a captured graph's), else the batch's own."""
        b = self.buffers
        qsl = [0]
        for s in batch.seqs:
            qsl.append(qsl[-1] + s.query_len)
        n_seqs = len(batch.seqs) if pad_seqs is None else pad_seqs
        n_tok = batch.num_tokens if pad_tokens is None else pad_tokens
        bs = self.block_size
        return TritonAttentionMetadata(
            slot_mapping=b.stage("slot_mapping", batch.slot_mapping, n_tok, fill=-1),
            block_table=b.stage_rows("block_table", [s.block_ids[:-(-s.seq_len // bs)] for s in batch.seqs],
                                     n_seqs),
            seq_lens=b.stage("seq_lens", [s.seq_len for s in batch.seqs], n_seqs, fill=0),
            query_start_loc=b.stage("query_start_loc", qsl, n_seqs + 1, fill=qsl[-1]),
            max_query_len=batch.max_query_len, num_decodes=batch.num_decodes, backend=self)

    def forward(self, q, k, v, kv_cache, meta: TritonAttentionMetadata, sliding_window: int | None = None
                ) -> torch.Tensor:
        if sliding_window is not None:  # refused at start-up (model_runner); never silently ignored
            raise NotImplementedError("the triton attention backend has no sliding-window attention yet")
        k_cache, v_cache = kv_cache
        self._reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self._paged_attention(q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.query_start_loc,
                                    self.scale, max_query_len=meta.max_query_len)
        return out.view(q.shape[0], -1)
