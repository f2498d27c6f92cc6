"""EngineCore: the synchronous heart. ``step()`` = schedule -> execute -> update -> outputs.

It owns the scheduler (with its KV-cache manager) and the model runner, and knows nothing of text,
streams or event loops: front ends (``LLM``, ``AsyncLLMEngine``) feed it validated ``Request``s and
route its ``EngineCoreOutput``s. The async engine drives the three phases itself to overlap them.
"""
from __future__ import annotations

import logging

import torch

from asyncengine.config import EngineConfig
from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.kv_sizing import KVModelShape, available_memory_bytes, plan_kv_cache
from asyncengine.core.request import Request
from asyncengine.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from asyncengine.core.scheduler import Scheduler
from asyncengine.executor.model_runner import ModelRunner
from asyncengine.models.loader import LoadedModel, load_model

log = logging.getLogger(__name__)


def num_kv_blocks_for(config: EngineConfig, loaded: LoadedModel) -> int:
    """The KV-cache policy (core/kv_sizing.py) applied to this model on this machine."""
    shape = KVModelShape.of(loaded.model.args, loaded.max_model_len)
    return plan_kv_cache(config, shape, available_memory_bytes(config.torch_device)).num_blocks


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.loaded = loaded or load_model(config)
        num_blocks = num_kv_blocks_for(config, self.loaded)
        # a request can never hold more tokens than the whole cache
        self.max_model_len = min(self.loaded.max_model_len, num_blocks * config.block_size)
        self.num_blocks = num_blocks
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, policy=config.policy,
            enable_chunked_prefill=config.enable_chunked_prefill, priority_aging_s=config.priority_aging_s)
        self.runner = ModelRunner(config, self.loaded, num_blocks)
        log.info("engine core: %d KV blocks of %d tokens, max_model_len %d, dtype %s",
                 num_blocks, config.block_size, self.max_model_len, config.torch_dtype)

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids) -> list[str]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # the three phases, separately, for the async engine's overlapped loop
    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(so)

    def update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        return self.scheduler.update(so, out)

    def step(self) -> list[EngineCoreOutput]:
        so = self.schedule()
        if so.is_empty:
            if so.finished_req_ids:  # let the runner drop state of aborted requests
                self.execute(so)
            return []
        return self.update(so, self.execute(so))

    def stats(self) -> dict:
        s = self.scheduler.stats
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_usage": self.kv.usage,
            "num_kv_blocks": self.num_blocks,
            "num_free_kv_blocks": self.kv.num_free_blocks,
            "num_preemptions": s.num_preemptions,
            "num_steps": s.num_steps,
            "num_scheduled_tokens": s.num_scheduled_tokens,
            "mean_scheduled_tokens_per_step": s.num_scheduled_tokens / s.num_steps if s.num_steps else 0.0,
            "num_computed_prompt_tokens": s.num_computed_prompt_tokens,
            "num_kv_evictions": self.kv.pool.num_evictions,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "prefix_cache_hit_rate": self.kv.prefix_hit_rate,
            "mean_queue_time_s": s.queue_time_s_total / s.num_started if s.num_started else 0.0,
        }
