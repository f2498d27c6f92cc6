"""Worker: one rank of the model. The same class runs in the engine's own thread (``uni``), in a
worker process (``mp``) or in a Ray actor (``ray``); executors only move messages to it.

Life cycle, driven by the executor: ``init_device`` (threads, seed, the tensor-parallel process
group) -> ``load_model`` (this rank's shard only) -> ``determine_kv_cache_spec`` (what a KV block
costs here and how much memory the rank can give) -> ``initialize_cache(KVCacheConfig)`` (the core
decided) -> ``execute_model`` every step. Everything else is a control call for ``collective_rpc``.
"""
from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING

import msgspec
import torch

from asyncengine.config import EngineConfig
from asyncengine.contracts.kv_cache_spec import KVCacheConfig, KVCacheGroup, KVCacheSpec, one_table_reason
from asyncengine.contracts.sched_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.layers.parallel import FULL, SINGLE, PPGroup, TPGroup
from asyncengine.platforms.onednn_caches import bound_onednn_caches
from asyncengine.worker.cpu_threads import ThreadGovernor
from asyncengine.attention.kv_cache import kv_bytes_per_block
from asyncengine.worker.kv_groups import groups_of, layers_per_block
from asyncengine.worker.model_runner import ModelRunner
from asyncengine.errors import ConfigError

if TYPE_CHECKING:
    from asyncengine.worker.weight_update import StageResult

log = logging.getLogger(__name__)


def _available_memory(device: torch.device) -> int | None:
    """Memory this rank could give the KV cache: the one measure (core/kv_sizing.py)."""
    from asyncengine.contracts.kv_sizing import available_memory_bytes  # lazy: only on this path (loading, profiling, a configuration)

    return available_memory_bytes(device)


def set_quantized_activations(model, mode: str) -> None:
    """Every block-quantized layer multiplies with ``mode`` activations ("auto": the process default),
    its weight in that mode's layout (``Linear.set_activations``: repacked in place)."""
    from asyncengine.layers.linear import Linear  # lazy: only on this path (loading, profiling, a configuration)

    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.set_activations(None if mode == "auto" else mode)


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
        self.pp: PPGroup = FULL
        self.model = None
        self.weights_dropped = False  # by sleep(level=2) (worker/sleep_mode.py)
        self.draft_model = None  # speculative decoding with a draft model
        self.runner: ModelRunner | None = None
        self.threads: ThreadGovernor | None = None

    # ------------------------------------------------------------------ set-up

    def init_device(self) -> None:
        c = self.config
        bound_onednn_caches()  # before the model's first GEMM in this process (platforms/onednn_caches.py)
        if c.num_threads:
            torch.set_num_threads(c.num_threads)
        elif self.world_size == 1 and c.torch_device.type == "cpu":
            # a count nobody pinned yields to other processes' load (worker/cpu_threads.py)
            self.threads = ThreadGovernor(torch.get_num_threads())
        torch.manual_seed(c.seed)
        if self.world_size > 1:
            import torch.distributed as dist

            dev = c.torch_device
            backend = "nccl" if dev.type == "cuda" else "gloo"
            if dev.type == "cuda":
                torch.cuda.set_device(self.rank % torch.cuda.device_count())
            dist.init_process_group(backend, init_method=self.init_method, rank=self.rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=c.distributed_timeout_s))
            # rank = stage x tp_size + tp rank: a stage's ranks form its tensor-parallel group; the
            # same tp rank of the next stage is where the hidden states go
            n_tp, n_pp = c.tensor_parallel_size, c.pipeline_parallel_size
            stage, tp_rank = divmod(self.rank, n_tp)
            group = dist.group.WORLD
            if n_pp > 1:
                timeout = timedelta(seconds=c.distributed_timeout_s)
                groups = [dist.new_group(list(range(s * n_tp, (s + 1) * n_tp)), timeout=timeout) for s in range(n_pp)]
                group = groups[stage]
                self.pp = PPGroup(rank=stage, size=n_pp, prev_rank=self.rank - n_tp if stage > 0 else None,
                                  next_rank=self.rank + n_tp if stage < n_pp - 1 else None)
            self.tp = TPGroup(rank=tp_rank, size=n_tp, group=group, vocab_parallel=c.tp_vocab_parallel,
                              fixed_order=c.batch_invariant, expert_parallel=c.enable_expert_parallel)

    def load_model(self, read_weights: bool = True) -> None:
        """``read_weights=False``: storage only (waking from sleep level 2 into a full update)."""
        from asyncengine.models.loader import load_model  # lazy: only on this path (loading, profiling, a configuration)

        if self._preloaded is not None and self.world_size == 1:
            self.model = self._preloaded.model
            self._preloaded = None
        else:
            self.model = load_model(self.config.model_config, tp=self.tp, tokenizer=False, hf_config=self._hf_config,
                                    pp=self.pp, read_weights=read_weights).model
        set_quantized_activations(self.model, self.config.quantized_activations)
        if self.config.torch_device.type == "cpu" and hasattr(self.model, "native_step") and self.pp.size == 1:
            from asyncengine.models.llama_native import NativeStep  # lazy: only on this path (loading, profiling, a configuration)

            self.model.native_step = NativeStep.for_model(self.model)
        spec = self.config.speculative
        if spec is not None and spec.method == "draft_model":
            draft_cfg = msgspec.structs.replace(self.config.model_config, model=spec.model, tokenizer=None)
            self.draft_model = load_model(draft_cfg, tokenizer=False).model
            if self.draft_model.args.vocab_size != self.model.args.vocab_size:
                raise ConfigError(f"speculative draft model {spec.model!r} has a vocabulary of "
                                  f"{self.draft_model.args.vocab_size}, the model {self.model.args.vocab_size}: "
                                  "a draft must share the tokenizer")
            set_quantized_activations(self.draft_model, self.config.quantized_activations)
        if self.config.batch_invariant:
            from asyncengine.layers import batch_invariant  # lazy: only on this path (loading, profiling, a configuration)

            for model in (self.model, self.draft_model):
                if model is not None:
                    batch_invariant.enable(model)
        elif self.config.torch_device.type == "cpu":
            from asyncengine.layers import packed_linear  # lazy: sleep, weight updates and hybrid models: loaded on first use

            for model in (self.model, self.draft_model):
                if model is not None:
                    packed_linear.prepack(model)

    def determine_kv_cache_spec(self) -> KVCacheSpec:
        c = self.config
        budget = None
        if c.torch_device.type == "cuda" and c.num_kv_blocks is None and c.kv_cache_bytes is None:
            budget = self.profile_kv_budget()
        # several block tables: a block spans one group's layers (worker/kv_groups.py)
        layers = layers_per_block(self._kv_groups())
        per_block = target = kv_bytes_per_block(self.model, c.block_size, c.torch_dtype, layers, c.kv_cache_dtype)
        if self.draft_model is not None:  # the draft's cache has as many blocks
            per_block += kv_bytes_per_block(self.draft_model, c.block_size, c.torch_dtype)
        state = self.model.state_bytes_per_seq(c.torch_dtype) if hasattr(self.model, "state_bytes_per_seq") else 0
        return KVCacheSpec(block_size=c.block_size, bytes_per_block=per_block,
                           available_bytes=_available_memory(c.torch_device), kv_budget_bytes=budget,
                           state_bytes_per_seq=state, target_bytes_per_block=target,
                           layer_windows=tuple(getattr(self.model.args, "layer_windows", ())))

    @torch.inference_mode()
    def profile_kv_budget(self) -> int:
        """CUDA: run the largest step (max_num_batched_tokens of prefill, then logits for
        max_num_seqs rows) on a throwaway cache, note the allocator's peak, and give the cache what
        ``gpu_memory_utilization`` of the device leaves beyond it (and beyond memory torch does not
        own: the CUDA context, other processes)."""
        from asyncengine.attention.backend import SeqChunk, StepBatch  # lazy: only on this path (loading, profiling, a configuration)
        from asyncengine.attention.selector import get_model_backend, model_backend_name  # lazy: only on this path (loading, profiling, a configuration)
        from asyncengine.worker.cuda_utils import kv_cache_budget  # lazy: CUDA graphs / pipeline parallel only when configured

        c, m = self.config, self.model
        a, dev = m.args, c.torch_device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        n = max(1, min(c.max_num_batched_tokens, a.max_positions))
        nb = -(-n // c.block_size)
        name = model_backend_name(c.attention_backend, c.attention_backend_name, a)
        backend = get_model_backend(name, a, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                                    head_dim=a.head_dim, block_size=c.block_size, num_blocks=nb,
                                    dtype=c.torch_dtype, device=dev, max_num_tokens=n, max_num_seqs=1,
                                    max_blocks_per_seq=nb, scale=getattr(a, "attn_scale", None))
        caches = backend.allocate_kv_caches(a.num_layers)
        meta = backend.build_metadata(StepBatch(seqs=[SeqChunk(0, n, 0, list(range(nb)))],
                                                slot_mapping=list(range(n))))
        extra = {}
        if getattr(m, "num_state_layers", 0):  # a hybrid: its Mamba layers need a (throwaway) state slot
            from asyncengine.worker.state_cache import StateCache  # lazy: sleep, weight updates and hybrid models: loaded on first use
            extra = {"ssm": StateCache(m, 1, c.torch_dtype, dev).step_meta([], [(0, n, 0, True)])}
        hidden = m(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), caches, meta, **extra)
        logits = m.compute_logits(hidden[:min(n, c.max_num_seqs)])
        if logits is not None:
            logits.float().softmax(-1)  # the sampler's fp32 copies are of this order
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        cache_bytes = sum(t.numel() * t.element_size() for kv in caches for t in kv)
        del caches, meta, hidden, logits, backend
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        not_torch = max(0, total - free - torch.cuda.memory_reserved(dev))
        budget = kv_cache_budget(total, c.gpu_memory_utilization, peak - cache_bytes + not_torch)
        log.info("KV cache budget %.2f GiB (profiled peak %.2f GiB, other %.2f GiB, %.0f%% of %.2f GiB)",
                 budget / 2**30, (peak - cache_bytes) / 2**30, not_torch / 2**30,
                 100 * c.gpu_memory_utilization, total / 2**30)
        return budget

    def _kv_groups(self) -> list[KVCacheGroup]:
        """The block tables over this model's layers, as the core decides them (worker/kv_groups.py)."""
        c = self.config
        return groups_of(self.model, one_table_reason(c.speculative, c.kv_transfer_config, c.parallel_config))

    def initialize_cache(self, kv: KVCacheConfig) -> None:
        """Build the cache the core planned: ``kv``'s block count and block size, never re-read
        from the config. The worker holds the engine's config; the runner gets the views it reads."""
        c = self.config
        self.runner = ModelRunner(
            self.model, kv, self.eos_token_ids, model_config=c.model_config, cache_config=c.cache_config,
            scheduler_config=c.scheduler_config, kv_groups=self._kv_groups(), kv_transfer_config=c.kv_transfer_config,
            lora_config=c.lora_config, multimodal_config=c.multimodal_config, speculative=c.speculative,
            grammar_limits=c.grammar_limits, tp=self.tp, draft_model=self.draft_model, pp=self.pp)

    # ------------------------------------------------------------------ the step

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.threads is not None and (n := self.threads.update()) is not None:
            torch.set_num_threads(n)
        return self.runner.execute(so)

    # ------------------------------------------------------------------ control calls

    def ping(self) -> int:
        return self.rank

    def runner_stats(self) -> dict:
        """Counters of this rank's runner, for stats and tests (what it holds, how busy it was)."""
        r = self.runner
        return {"rank": self.rank, "pid": os.getpid(), "num_threads": torch.get_num_threads(),
                "pp_rank": self.pp.rank, "tp_rank": self.tp.rank, "recv_wait_s": r.recv_wait_s,
                "execute_time_s": r.execute_time_s,
                "request_ids": sorted(r.requests), "num_kv_blocks": r.num_blocks,
                "weight_bytes": self.weight_bytes(),
                "draft_tokens_processed": r.proposer.num_tokens_processed if r.proposer else 0,
                "draft_forwards": r.proposer.num_forwards if r.proposer else 0,
                "grammar_time_s": r.grammar_time_s,
                # MoE: the experts each layer of this rank holds (all of them, or 1/N under expert parallel)
                "moe_local_experts": [m.shard.num_local for m in r.moe_layers]}

    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds (its shard): dense parameters and quantized blocks."""
        from asyncengine.layers.linear import weight_nbytes  # lazy: only on this path (loading, profiling, a configuration)

        return weight_nbytes(self.model)

    def attention_backend_name(self) -> str:
        """The backend this rank's model runs on: auto may have fallen back for the model (Gemma on CUDA)."""
        return self.runner.attn_backend.name

    def kv_transfer_address(self) -> str | None:
        """Where this rank serves its P/D transfers (``host:port`` as bound; None: nowhere)."""
        conn = self.runner.kv_connector if self.runner is not None else None
        return conn.serving_address() if conn is not None else None

    # ------------------------------------------------------------------ weight updates (two-phase)

    def stage_weight_update(self, update) -> "StageResult":
        """Check ``update`` (worker/weight_update.py) against this rank's model and keep it for
        :meth:`commit_weight_update`; nothing changes yet. Problems come back in the result (every
        rank answers, so the core can refuse the update on all of them)."""
        from asyncengine.worker import sleep_mode  # lazy: sleep, weight updates and hybrid models: loaded on first use
        from asyncengine.worker import weight_update as wu  # lazy: sleep, weight updates and hybrid models: loaded on first use

        self._staged = None
        try:
            sleep_mode.weights_for_update(self, update)
            staged = wu.stage(self.model, update, self.tp.size)
        except ValueError as e:
            return wu.StageResult(rank=self.rank, num_tensors=0, error=str(e))
        self._staged = staged
        return wu.StageResult(rank=self.rank, num_tensors=len(staged.entries), unclaimed=staged.unclaimed)

    def commit_weight_update(self) -> int:
        """Apply the staged update (every rank staged it cleanly); returns how many tensors."""
        from asyncengine.worker import weight_update as wu  # lazy: sleep, weight updates and hybrid models: loaded on first use

        staged, self._staged = getattr(self, "_staged", None), None
        if staged is None:
            raise RuntimeError("commit_weight_update without a staged update")
        n = wu.apply(self.model, staged)
        self.weights_dropped = False
        return n

    def discard_weight_update(self) -> None:
        self._staged = None

    def sleep(self, level: int) -> int:
        """Free the KV cache and the packed weight copies (level 2: the weights too); returns the
        process's RSS after (worker/sleep_mode.py)."""
        from asyncengine.worker import sleep_mode  # lazy: sleep, weight updates and hybrid models: loaded on first use

        return sleep_mode.sleep(self, level)

    def wake_up(self, tags: list[str]) -> int:
        from asyncengine.worker import sleep_mode  # lazy: sleep, weight updates and hybrid models: loaded on first use

        return sleep_mode.wake_up(self, tags)

    def reset_requests(self) -> None:
        """Forget every request's state (the core abandoned them all)."""
        if self.runner is not None:
            self.runner.reset_requests()

    def shutdown(self) -> None:
        if self.runner is not None and self.runner.kv_connector is not None:
            self.runner.kv_connector.close()
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # a peer may be gone already
                    pass
