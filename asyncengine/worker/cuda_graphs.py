"""CUDA graphs for decode steps: one graph per captured batch size, replayed with the batch padded
to that size. A decode step of a small model is dozens of kernel launches of a few microseconds of
work each; replaying a graph launches them all at once, so the step costs GPU time, not Python
and launch overhead.

What makes capture possible: every input the graph reads lives at a fixed address (the runner's
persistent ``input_ids`` / ``positions`` buffers and the triton backend's metadata buffers, which
``build_metadata`` refills in place), and the triton kernels take their launch sizes from tensor
shapes only (no host sync). Padding rows carry token 0 at position 0, no cache slot (-1), and
belong to no sequence (``query_start_loc`` repeats), so they write nothing and their outputs are
ignored.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from asyncengine.attention.backend import SeqChunk, StepBatch
from asyncengine.attention.buffers import PersistentBuffers
from asyncengine.config.attention import backend_info
from asyncengine.config.sub_configs import ModelConfig, SchedulerConfig
from asyncengine.worker.cuda_utils import capture_sizes, padded_batch_size

log = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, model, backend, kv_caches, inputs: PersistentBuffers, max_num_seqs: int,
                 max_capture_size: int = 256) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.inputs = inputs
        self.sizes = capture_sizes(min(max_num_seqs, backend.max_num_seqs), max_capture_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _dummy(self, n: int) -> tuple[torch.Tensor, torch.Tensor, object]:
        """A padded all-padding decode batch of size n (its values are irrelevant to the capture)."""
        batch = StepBatch(seqs=[], slot_mapping=[], num_decodes=0)
        ids = self.inputs.stage("input_ids", [], n, fill=0)
        pos = self.inputs.stage("positions", [], n, fill=0)
        meta = self.backend.build_metadata(batch, pad_tokens=n, pad_seqs=n)
        meta.max_query_len = 1
        return ids, pos, meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (so smaller graphs reuse its memory pool)."""
        torch.cuda.synchronize()
        for n in reversed(self.sizes):
            ids, pos, meta = self._dummy(n)
            for _ in range(2):  # warm up: triton compiles, lazy tables are built, outside the graph
                self.model(ids, pos, self.kv_caches, meta)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self.model(ids, pos, self.kv_caches, meta)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[n] = g
            self.outputs[n] = out
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def size_for(self, num_decodes: int) -> int | None:
        return padded_batch_size(num_decodes, self.sizes) if num_decodes else None

    def run(self, n: int, input_ids: list[int], positions: list[int], seqs: list[SeqChunk],
            slots: list[int]) -> torch.Tensor:
        """Refill the captured buffers with this decode batch (padded to n) and replay; the hidden
        states of the real rows."""
        m = len(input_ids)
        self.inputs.stage("input_ids", input_ids, n, fill=0)
        self.inputs.stage("positions", positions, n, fill=0)
        self.backend.build_metadata(StepBatch(seqs=seqs, slot_mapping=slots, num_decodes=m),
                                    pad_tokens=n, pad_seqs=n)
        self.graphs[n].replay()
        return self.outputs[n][:m]


def decode_graphs_for(runner: Any, model_config: ModelConfig, sched: SchedulerConfig) -> DecodeGraphs | None:
    """The runner's decode graphs, captured at start, where they apply: a capturable backend, one
    rank, no per-step host decisions (Mamba state slots, MoE expert groups, per-group block tables,
    an encoder's per-step sequence splits, M-RoPE's per-step positions).
    A capture failure costs speed, never correctness: the runner then runs eagerly."""
    if not (backend_info(runner.attn_backend.name).cuda_graphs and not model_config.enforce_eager
            and runner.tp.size == 1 and runner.pp.size == 1 and runner.state_cache is None
            and not getattr(runner.model, "is_moe", False) and not getattr(runner.model, "uses_token_types", False)
            and not getattr(runner.model, "uses_mrope", False) and len(runner.kv_groups) <= 1):
        return None
    try:
        # a decode batch has at most max_num_batched_tokens rows: the input buffers' size
        largest = min(sched.max_num_seqs, sched.max_num_batched_tokens)
        graphs = DecodeGraphs(runner.model, runner.attn_backend, runner.kv_caches, runner.inputs, largest)
        graphs.capture()
        return graphs
    except Exception:
        log.warning("CUDA graph capture failed; decode steps run eagerly", exc_info=True)
        return None
