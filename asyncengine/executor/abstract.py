"""Executor: what the engine core calls to run a step, wherever the model lives.

The core never touches a runner, a model or a KV tensor: it hands the executor one
``SchedulerOutput`` per step and gets back a future of the step's ``ModelRunnerOutput``, so that
the engine core's step pipeline can keep ``max_concurrent_batches`` in flight with any executor. Implementations:

- ``uni`` (:mod:`asyncengine.executor.uniproc`): one worker on a thread of this process.
- ``mp`` (:mod:`asyncengine.executor.multiproc`): tensor-parallel worker processes on this machine.
- ``ray`` (:mod:`asyncengine.executor.ray_executor`): workers as Ray actors, any number of nodes.

(:func:`asyncengine.executor.selector.executor_class` picks one.)

Life cycle: the constructor starts the workers, which load their part of the model;
:meth:`determine_kv_cache_spec` reports what one block costs per rank and what memory the ranks
have; the core picks the block count and calls :meth:`initialize_cache`; then steps.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

from asyncengine.config import EngineConfig
from asyncengine.contracts.kv_cache_spec import KVCacheConfig, KVCacheSpec
from asyncengine.contracts.sched_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.models.model_info import ModelInfo


class Executor(ABC):
    def __init__(self, config: EngineConfig, model_info: ModelInfo, loaded=None) -> None:
        """Start the workers; each loads its part of the model. ``loaded``: an already loaded
        model (``uni`` only)."""
        self.config = config
        self.eos_token_ids = list(model_info.eos_token_ids)
        to_dict = getattr(model_info.hf_config, "to_dict", None)
        self.hf_config_dict = to_dict() if to_dict is not None else dict(vars(model_info.hf_config))

    @property
    def max_concurrent_batches(self) -> int:
        """How many batches the engine core keeps in flight here: one per pipeline stage (they are
        disjoint), else 2 with async scheduling (step N+1 planned while N runs), else 1."""
        if self.config.pipeline_parallel_size > 1:
            return self.config.pipeline_parallel_size
        return 2 if self.config.async_scheduling else 1

    def determine_kv_cache_spec(self) -> KVCacheSpec:
        """The most constrained rank's view: the largest block, the least free memory."""
        specs = self.collective_rpc("determine_kv_cache_spec")
        avail = [s.available_bytes for s in specs if s.available_bytes is not None]
        budgets = [s.kv_budget_bytes for s in specs if s.kv_budget_bytes is not None]
        if len({s.block_size for s in specs}) != 1:
            raise RuntimeError(f"ranks disagree on the KV block size: {[s.block_size for s in specs]}")
        return KVCacheSpec(block_size=specs[0].block_size, bytes_per_block=max(s.bytes_per_block for s in specs),
                           available_bytes=min(avail) if avail else None,
                           kv_budget_bytes=min(budgets) if budgets else None,
                           state_bytes_per_seq=max(s.state_bytes_per_seq for s in specs),
                           target_bytes_per_block=max(s.target_bytes_per_block for s in specs),
                           layer_windows=specs[0].layer_windows)

    def initialize_cache(self, kv: KVCacheConfig) -> None:
        self.collective_rpc("initialize_cache", (kv,))

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        """Queue one step; steps run in the order given. The future fails with the worker's error,
        or with EngineDeadError when a worker is gone."""

    @abstractmethod
    def collective_rpc(self, method: str | Any, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None, non_block: bool = False) -> list | "Future[list]":
        """Call ``method`` (a Worker method name, or a picklable function taking the worker first)
        on every rank, in order with the steps queued before it; the ranks' results in rank order.
        For rare control messages (stats, resets, tests' fault injection), never per step."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise EngineDeadError if a worker is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers (idempotent); no worker process outlives it."""
