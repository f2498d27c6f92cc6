"""Worker: one rank of the model. The same class runs in the engine's own thread (``uni``), in a
worker process (``mp``) or in a Ray actor (``ray``); executors only move messages to it.

Life cycle, driven by the executor: ``init_device`` (threads, seed, the tensor-parallel process
group) -> ``load_model`` (this rank's shard only) -> ``determine_kv_cache_spec`` (what a KV block
costs here and how much memory the rank can give) -> ``initialize_cache(num_blocks)`` (the core
decided) -> ``execute_model`` every step. Everything else is a control call for ``collective_rpc``.
"""
from __future__ import annotations

import logging
import os
from datetime import timedelta

import msgspec
import torch

from asyncengine.config import EngineConfig
from asyncengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.layers.parallel import SINGLE, TPGroup
from asyncengine.worker.model_runner import ModelRunner, kv_bytes_per_block

log = logging.getLogger(__name__)


class KVCacheSpec(msgspec.Struct, kw_only=True):
    """What one rank reports before the core sizes the KV cache."""

    bytes_per_block: int  # this rank's share of one block (its KV heads only)
    available_bytes: int | None  # memory the rank could give the cache (None: unknown)


def _available_memory(device: torch.device) -> int | None:
    """Memory this rank could give the KV cache: the one measure (core/kv_sizing.py)."""
    from asyncengine.core.kv_sizing import available_memory_bytes

    return available_memory_bytes(device)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 distributed_init_method: str | None = None, eos_token_ids: list[int] | None = None,
                 loaded=None, hf_config: dict | None = None) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.init_method = distributed_init_method
        self.eos_token_ids = list(eos_token_ids or [])
        self._preloaded = loaded  # uni only: tests share one loaded model between engines
        self._hf_config = hf_config
        self.tp: TPGroup = SINGLE
        self.model = None
        self.runner: ModelRunner | None = None

    # ------------------------------------------------------------------ set-up

    def init_device(self) -> None:
        c = self.config
        if c.num_threads:
            torch.set_num_threads(c.num_threads)
        torch.manual_seed(c.seed)
        if self.world_size > 1:
            import torch.distributed as dist

            dev = c.torch_device
            backend = "nccl" if dev.type == "cuda" else "gloo"
            if dev.type == "cuda":
                torch.cuda.set_device(self.rank % torch.cuda.device_count())
            dist.init_process_group(backend, init_method=self.init_method, rank=self.rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=c.distributed_timeout_s))
            self.tp = TPGroup(rank=self.rank, size=self.world_size, group=dist.group.WORLD)

    def load_model(self) -> None:
        from asyncengine.models.loader import load_model

        if self._preloaded is not None and self.world_size == 1:
            self.model = self._preloaded.model
            self._preloaded = None
        else:
            self.model = load_model(self.config, tp=self.tp, tokenizer=False, hf_config=self._hf_config).model

    def determine_kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(bytes_per_block=kv_bytes_per_block(self.model, self.config.block_size,
                                                              self.config.torch_dtype),
                           available_bytes=_available_memory(self.config.torch_device))

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner = ModelRunner(self.config, self.model, num_blocks, self.eos_token_ids, self.tp)

    # ------------------------------------------------------------------ the step

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.runner.execute(so)

    # ------------------------------------------------------------------ control calls

    def ping(self) -> int:
        return self.rank

    def runner_stats(self) -> dict:
        """Counters of this rank's runner, for stats and tests (what it holds, how busy it was)."""
        r = self.runner
        return {"rank": self.rank, "pid": os.getpid(), "execute_time_s": r.execute_time_s,
                "request_ids": sorted(r.requests), "num_kv_blocks": r.num_blocks,
                "weight_bytes": self.weight_bytes()}

    def weight_bytes(self) -> int:
        """Bytes of the parameters this rank holds (its shard)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def reset_requests(self) -> None:
        """Forget every request's state (the core abandoned them all)."""
        if self.runner is not None:
            self.runner.requests.clear()
            self.runner._prompt_logprob_ids.clear()

    def shutdown(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # a peer may be gone already
                    pass
