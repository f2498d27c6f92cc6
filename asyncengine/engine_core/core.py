"""EngineCore: the heart. It owns the scheduler (with its KV-cache manager), an executor, and the
step pipeline: a queue of in-flight batches (schedule -> execute -> update), the one
implementation every driver runs (the offline ``LLM``, the in-process async engine's client, a
core process, data-parallel and Ray cores).

It knows nothing of text, streams or event loops: front ends feed it validated ``Request``s and
route its ``EngineCoreOutputs``. The model, its weights and the KV tensors live behind the executor
(a thread, worker processes or Ray actors): the core sees only messages. It sits above the
executor it drives (engine/ -> executor/ -> worker/).
"""
from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from concurrent.futures import Future, wait

import torch

from asyncengine.config import EngineConfig
from asyncengine.core.hybrid_kv_cache_manager import check_hybrid_config, make_hybrid_kv_cache_manager
from asyncengine.core.grouped_kv_cache_manager import make_kv_cache_manager, max_request_len
from asyncengine.contracts.kv_sizing import plan_kv_blocks
from asyncengine.contracts.kv_cache_spec import KVCacheConfig, KVCacheSpec, one_table_reason, table_groups
from asyncengine.core.request import Request
from asyncengine.contracts.sched_output import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from asyncengine.core.scheduler import Scheduler
from asyncengine.engine_core.core_stats import moe_stats
from asyncengine.executor.abstract import Executor
from asyncengine.executor.selector import executor_class
from asyncengine.kv_connector.factory import make_scheduler_connector
from asyncengine.kv_connector.offload.fingerprint import kv_fingerprint
from asyncengine.models.layer_kinds import has_state_layers
from asyncengine.models.model_info import ModelInfo, load_model_info
from asyncengine.models.pooling_models import encoder_engine_config
from asyncengine.models.registry import TRANSFORMERS_BACKEND, check_architecture

log = logging.getLogger(__name__)


def num_kv_blocks_for(config: EngineConfig, spec: KVCacheSpec, max_model_len: int) -> int:
    """The KV-cache policy (core/kv_sizing.py) applied to what a block costs on a rank (its share
    of the KV heads), the memory the ranks reported and, on CUDA, their profiled budget. A model
    mixing full and sliding layers is planned in whole-model blocks like any other, and its pool
    gets as many of its one-group blocks as that memory holds (core/grouped_kv_cache_manager.py)."""
    groups = table_groups(spec.layer_windows, one_table_reason(config.speculative, config.kv_transfer_config,
                                                               config.parallel_config))
    size = max(len(g.layers) for g in groups) if len(groups) > 1 else 0
    layers = len(spec.layer_windows)
    per_block = spec.bytes_per_block * layers // size if size else spec.bytes_per_block
    seqs = config.scheduler_config.max_num_seqs
    n = plan_kv_blocks(config.cache_config, seqs, per_block, max_model_len, spec.available_bytes,
                       spec.kv_budget_bytes, spec.state_bytes_per_seq * seqs).num_blocks
    return n * layers // size if size else n


class EngineCore:
    def __init__(self, config: EngineConfig, loaded=None, info: ModelInfo | None = None) -> None:
        """``loaded``: an already loaded model (``uni`` only; tests share one between engines).
        ``info``: the model's config/tokenizer if the caller already read them."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        if info is None and loaded is not None:
            info = ModelInfo(hf_config=loaded.hf_config, tokenizer=loaded.tokenizer,
                             eos_token_ids=list(loaded.eos_token_ids), max_model_len=loaded.max_model_len,
                             vocab_size=loaded.hf_config.vocab_size, path=loaded.path,
                             generation_config=getattr(loaded, "generation_config", None))
        self.model_info = info or load_model_info(config.model_config)
        self.config = config = encoder_engine_config(config, self.model_info)  # an encoder: whole prompts per step
        if config.tensor_parallel_size > 1:  # refuse an unsplittable model before spawning workers
            from asyncengine.models.registry import resolve_architecture  # lazy: only for this configuration (TP, PP, a kernel report)
            cls = resolve_architecture(self.model_info.hf_config, config.model_impl)
            ep = {"expert_parallel": True} if config.enable_expert_parallel and getattr(cls, "is_moe", False) else {}
            cls.check_tensor_parallel(self.model_info.hf_config, config.tensor_parallel_size, **ep)
        hybrid = has_state_layers(self.model_info.hf_config)
        if hybrid:
            check_hybrid_config(config.speculative, config.kv_transfer_config, config.parallel_config,
                                self.model_info.hf_config)
        if config.pipeline_parallel_size > 1:
            from asyncengine.layers.parallel import layer_split  # lazy: only for this configuration (TP, PP, a kernel report)
            layer_split(self.model_info.hf_config.num_hidden_layers, config.pipeline_parallel_size)
        self.executor: Executor = executor_class(config)(config, self.model_info, loaded)
        try:
            spec = self.executor.determine_kv_cache_spec()
            num_blocks = num_kv_blocks_for(config, spec, self.model_info.max_model_len)
            # the block size the ranks laid their cache out with: the one source from here on
            plan = KVCacheConfig(num_blocks=num_blocks, block_size=spec.block_size)
            self.executor.initialize_cache(plan)
            if not hybrid:  # by attention kind: full, or sliding (core/sliding_window_kv_cache_manager.py)
                self.kv = make_kv_cache_manager(config.cache_config, spec.layer_windows, num_blocks,
                                                speculative=config.speculative, kv_transfer=config.kv_transfer_config,
                                                parallel=config.parallel_config)
        except BaseException:
            self.executor.shutdown()
            raise
        self.num_blocks = num_blocks
        if hybrid:  # attention blocks + a state slot per request (core/hybrid_kv_cache_manager.py)
            self.kv = make_hybrid_kv_cache_manager(plan, config.cache_config, config.scheduler_config,
                                                   self.model_info.hf_config, spec.state_bytes_per_seq)
        # a request can never hold more tokens than the whole cache (a sliding-window one: its window)
        self.max_model_len = max_request_len(self.kv, config.scheduler_config, num_blocks, self.model_info.max_model_len)
        kv_connector = make_scheduler_connector(config.kv_transfer_config, self.kv, spec.connector_bytes_per_block,
                                                functools.partial(kv_fingerprint, config.model_config,
                                                                  config.cache_config, config.tensor_parallel_size))
        self.scheduler = Scheduler(
            self.kv, config.scheduler_config, max_model_len=self.max_model_len,
            num_spec_tokens=config.speculative.num_speculative_tokens if config.speculative else 0,
            kv_connector=kv_connector, pipeline_parallel=config.parallel_config.pipeline_parallel_size > 1,
            lora=config.lora_config)
        self.execute_time_s = 0.0  # time the workers spent in steps (rank 0), for the busy metric
        self.expert_tokens: list[int] = []  # MoE: tokens routed to each expert since start
        self.last_expert_tokens: list[int] = []  # ... and in the last step that ran MoE layers
        # the overlap, seen from here: steps handed to the executor while an earlier one was still
        # running there (the overlapped busy loop's whole point; 0 without async_scheduling)
        self._steps_in_flight = 0
        self.num_overlapped_steps = 0
        self._flight_lock = threading.Lock()
        # the step pipeline: (schedule, future of its result, weights version it runs on), oldest first
        self._batches: deque[tuple[SchedulerOutput, Future, int]] = deque()
        # bumped by every weight update (engine_core/weight_sync.py); each batch's outputs carry the
        # version their step ran on (the update's control call is queued behind earlier steps)
        self.weights_version = 0
        # pause_generation("keep"): nothing new is scheduled, the requests keep their KV blocks
        self.scheduling_paused = False
        # sleep(): what is freed on the ranks ("weights", "kv_cache"): nothing is scheduled meanwhile
        self.asleep: set[str] = set()
        self.batch_queue_size = self.executor.max_concurrent_batches
        self._started: dict[str, float] = {}  # scheduled for the first time since take_outputs(): id -> when
        self.dtype = str(config.torch_dtype).removeprefix("torch.")  # what front ends report ("float32")
        self.kernels = self._describe_kernels(config)  # the dtype and why, the kernels (the CLI's ready line)
        # a P/D prefill core's transfer server as bound (port 0: the OS's choice), for decode cores
        self.kv_transfer_address: str | None = (self.executor.collective_rpc("kv_transfer_address")[0]
                                                if config.kv_role == "prefill" else None)
        log.info("engine core: %s executor, TP=%d, PP=%d, %d KV blocks of %d tokens, max_model_len %d, %s",
                 config.distributed_executor_backend, config.tensor_parallel_size, config.pipeline_parallel_size,
                 num_blocks, plan.block_size, self.max_model_len, self.kernels)

    def _describe_kernels(self, config: EngineConfig) -> str:
        from asyncengine.worker.kernel_info import describe  # lazy: the worker's weight code loads only for an update

        impl = check_architecture(self.model_info.hf_config, config.model_impl)
        return describe(config.model_config, via_transformers=impl == TRANSFORMERS_BACKEND,
                        attention=self.executor.collective_rpc("attention_backend_name")[0])

    @property
    def vocab_size(self) -> int:
        return self.model_info.vocab_size

    @property
    def tokenizer(self):
        return self.model_info.tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return self.model_info.eos_token_ids

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids) -> list[str]:
        return self.scheduler.abort_requests(request_ids)

    def abort_all(self) -> None:
        """Abort every request and make the workers forget theirs (after the steps queued)."""
        self.drop_batches()
        self.scheduler.abort_requests(list(self.scheduler.requests))
        try:
            self.executor.collective_rpc("reset_requests", non_block=True)
        except Exception:  # the executor is gone: nothing holds request state any more
            pass

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    # ------------------------------------------------------------------ the three phases

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def execute_model(self, so: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        with self._flight_lock:
            self.num_overlapped_steps += self._steps_in_flight > 0
            self._steps_in_flight += 1
        fut = self.executor.execute_model(so)
        fut.add_done_callback(self._step_done)
        return fut

    def _step_done(self, _fut) -> None:
        with self._flight_lock:
            self._steps_in_flight -= 1

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model(so).result()

    def update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        self.execute_time_s += out.execute_time_s
        if out.expert_tokens:  # MoE load balance: tokens per expert, since start and this step
            self.last_expert_tokens = out.expert_tokens
            self.expert_tokens = [a + b for a, b in zip(self.expert_tokens, out.expert_tokens)] \
                if self.expert_tokens else list(out.expert_tokens)
        return self.scheduler.update(so, out)

    # ------------------------------------------------------------------ the step pipeline
    # One queue of in-flight batches (vLLM's ``step_with_batch_queue``), for every driver: fill it
    # with non-blocking executes while work exists, wait on the oldest, update, refill before the
    # caller routes the outputs. Depth 1 = the plain loop, 2 = async scheduling (step N+1 planned on
    # placeholders while N runs), P = pipeline parallelism (P disjoint batches in the pipe).

    def has_work(self) -> bool:
        """Batches in flight or requests left."""
        return bool(self._batches) or self.scheduler.has_unfinished()

    def fill_batch_queue(self, depth: int | None = None) -> None:
        """Schedule and hand the executor batches until ``depth`` (default: the queue's size) are
        in flight or nothing more can be scheduled. An empty schedule that only ends requests is
        still sent (the runner drops their state) but ends the filling."""
        depth = self.batch_queue_size if depth is None else depth
        while len(self._batches) < depth and self.scheduler.has_unfinished() and not (self.scheduling_paused or self.asleep):
            so = self.schedule()
            if so.is_empty and not so.finished_req_ids:
                return
            self._submit(so)
            if so.is_empty:
                return

    def _submit(self, so: SchedulerOutput) -> None:
        requests = self.scheduler.requests
        for nr in so.new_requests:  # (a preempted request comes back as new: its first time stays)
            req = requests.get(nr.req_id)
            if req is not None and req.first_scheduled_time is not None:
                self._started[nr.req_id] = req.first_scheduled_time
        self._batches.append((so, self.execute_model(so), self.weights_version))

    def oldest_batch(self) -> "Future[ModelRunnerOutput] | None":
        """The future of the batch that finishes next (None: nothing in flight). Await it (the
        async engine, on its event loop) or block on it, then call :meth:`finish_oldest_batch`."""
        return self._batches[0][1] if self._batches else None

    def finish_oldest_batch(self, refill: bool = True) -> EngineCoreOutputs:
        """Fold the oldest batch's (finished) result into the requests; with ``refill``, queue the
        next batches before returning, so the model runs while the caller routes these outputs."""
        so, fut, version = self._batches.popleft()  # consumed even if it failed
        try:
            result = fut.result()
        except BaseException:
            # the batches behind it were planned on its tokens: they are void (the executor still
            # runs them, in order; their results are dropped). The caller aborts the requests.
            self.drop_batches()
            raise
        outputs = self.update(so, result)
        if refill:
            self.fill_batch_queue()
        return self.take_outputs(outputs, version)

    def take_outputs(self, outputs: list[EngineCoreOutput] = (), version: int | None = None) -> EngineCoreOutputs:
        """``outputs`` (of a batch run on weights ``version``) with the core's load and the requests
        started since the last call."""
        started, self._started = self._started, {}
        return EngineCoreOutputs(outputs=list(outputs), num_running=self.scheduler.num_running,
                                 num_waiting=self.scheduler.num_waiting, started=started,
                                 weights_version=self.weights_version if version is None else version)

    def step_with_batch_queue(self) -> EngineCoreOutputs | None:
        """One turn of the pipeline, blocking: fill, wait on the oldest, update, refill. None when
        nothing is in flight and nothing can be scheduled."""
        self.fill_batch_queue()
        fut = self.oldest_batch()
        if fut is None:
            return None
        wait([fut])
        return self.finish_oldest_batch()

    def step(self) -> list[EngineCoreOutput]:
        """The plain loop's step, on the same queue: finish the oldest batch in flight, or schedule,
        execute and wait for one (also a schedule that only ends requests: the runner drops their
        state), refilling nothing."""
        if not self._batches:
            so = self.schedule()
            if so.is_empty and not so.finished_req_ids:
                return []
            self._submit(so)
        return self.finish_oldest_batch(refill=False).outputs

    def drop_batches(self) -> None:
        """Forget the batches in flight (their requests were all abandoned); the executor still
        runs them, in order, before anything queued later."""
        self._batches.clear()
        self._started.clear()

    # weights (engine_core/weight_sync.py: two-phase, every rank checks before any changes)
    def update_weights(self, weights, partial: bool = False) -> int:
        """Replace the model's weights in place (a state_dict, (name, tensor) pairs in the
        checkpoint's naming, or a safetensors path); returns the new ``weights_version``. A bad
        update raises WeightUpdateError and changes nothing."""
        from asyncengine.engine_core import weight_sync  # lazy: weight updates and sleep: loaded on first use

        return weight_sync.update_blocking(self, weights, partial)

    def sleep(self, level: int = 1) -> list[int]:
        """Free the KV cache and packed weight copies on every rank (level 2: the weights too);
        the core must be idle (engine_core/sleep.py). Returns each rank's RSS after."""
        from asyncengine.engine_core import sleep  # lazy: weight updates and sleep: loaded on first use

        return sleep.sleep(self, level)

    def wake_up(self, tags: list[str] | None = None) -> list[int]:
        from asyncengine.engine_core import sleep  # lazy: weight updates and sleep: loaded on first use

        return sleep.wake_up(self, tags)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (and the offload tier's entries, whose keys chain from the
        same root): new requests recompute their whole prompt."""
        self.scheduler.kv.reset_prefix_cache(self.scheduler.requests.values())

    # control
    def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        return self.executor.collective_rpc(method, args, kwargs, timeout)

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()

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
            "executor_busy_s": self.execute_time_s,
            "num_overlapped_steps": self.num_overlapped_steps,
            # speculative decoding (0 when off): drafts proposed / accepted, and per verify step the
            # mean number of tokens a request got (1 + accepted drafts)
            "spec_num_drafts": s.spec_num_drafts,
            "spec_num_draft_tokens": s.spec_num_draft_tokens,
            "spec_num_accepted_tokens": s.spec_num_accepted_tokens,
            "spec_acceptance_rate": (s.spec_num_accepted_tokens / s.spec_num_draft_tokens
                                     if s.spec_num_draft_tokens else 0.0),
            "spec_mean_accepted_length": (1 + s.spec_num_accepted_tokens / s.spec_num_drafts
                                          if s.spec_num_drafts else 0.0),
            **self.scheduler.kv_connector_stats(),
            **moe_stats(self.expert_tokens, self.last_expert_tokens),
            # hybrid models: the state-slot cache group (absent for pure attention models)
            **(self.kv.group_stats() if hasattr(self.kv, "group_stats") else {}),
        }
