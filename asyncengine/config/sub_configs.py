"""Typed, read-only views of the flat ``EngineConfig``, one per part of the engine.

Users and the CLI see one flat ``EngineConfig`` (its fields, validation and flags stay the public
surface). Inside, each part is handed only the view it reads, so that what a part depends on is
visible in its signature and a test can build it without a whole engine config:

==============================  =========================  =========================================
view (``EngineConfig.<name>``)  type                       handed to
==============================  =========================  =========================================
``model_config``                :class:`ModelConfig`       model loading, model runner, grammar, kernels
``cache_config``                :class:`CacheConfig`       KV-cache manager, KV sizing, workers
``scheduler_config``            :class:`SchedulerConfig`   Scheduler (and the hybrid cache's slots)
``parallel_config``             :class:`ParallelConfig`    executors, workers, data-parallel cores
``kv_transfer_config``          :class:`KVTransferConfig`  KV connectors (offload, P/D)
``lora_config``                 :class:`LoRAConfig`        LoRA slots and admission (lora/, core/)
``multimodal_config``           :class:`MultiModalConfig`  image limits (multimodal/), encoder cache
``speculative``                 ``SpeculativeConfig``      spec decode (config/speculative.py)
==============================  =========================  =========================================

Design: every view's fields carry the EngineConfig field's own name, so a view is built by copying
those attributes (:func:`build`), once per EngineConfig, on first use (``functools.cached_property``
in :class:`SubConfigViews`, which EngineConfig inherits). EngineConfig is validated in
``__post_init__`` and not mutated afterwards (``dataclasses.replace`` makes a new one, with fresh
views); the views are frozen, so a part cannot change what another part reads.

Every EngineConfig field has exactly one home: one view here, a config object of its own
(:data:`OTHER_HOMES`) or :data:`ENGINE_ONLY` (tests/config/test_sub_configs.py checks it).
"""
from __future__ import annotations

import functools
from typing import TypeVar

import msgspec

from asyncengine.config.device import (block_quantized, check_quantization_device, dtype_reason, resolve_device,
                                       resolve_dtype)
from asyncengine.config.attention import resolve_backend_name
from asyncengine.platforms.onednn_caches import bound_onednn_caches


def _rebuilt(view: type, fields: dict, resolved: dict):
    """A view unpickled with what it had resolved (another process gets the same device and dtype)."""
    obj = view(**fields)
    obj.__dict__.update(resolved)
    return obj


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    """What is loaded and how it computes (models/, worker/model_runner.py). The device, dtype and
    attention backend are resolved here, on first use in the process that runs the model (torch,
    and "auto" asks the machine: config/device.py); ``EngineConfig.torch_device`` and its kin
    return these, so the loader and the runner need nothing but this view."""

    model: str | None
    tokenizer: str | None
    dtype: object  # a name ("auto", "bf16", ...) or a torch.dtype: EngineConfig.torch_dtype resolves it
    device: str
    max_model_len: int | None  # the asked-for cap; the engine core resolves the real one
    seed: int
    skip_tokenizer_init: bool
    attention_backend: str
    enforce_eager: bool
    quantization: str | None
    quantized_activations: str
    batch_invariant: bool
    model_impl: str  # "auto" | "native" | "transformers" (models/registry.py)
    runner: str  # "auto" | "generate" | "pooling" (config/runner.py, models/pooling_models.py)

    @functools.cached_property
    def torch_device(self):
        # before this process's first oneDNN call (the dtype probe's GEMMs come after this)
        bound_onednn_caches()
        dev = resolve_device(self.device)
        check_quantization_device(self.quantization, dev.type)
        return dev

    @functools.cached_property
    def torch_dtype(self):
        if self.dtype == "auto" and self.torch_device.type == "cpu" and self.block_quantized_weights:
            import torch

            return torch.float32
        return resolve_dtype(self.dtype, self.torch_device)

    @property
    def block_quantized_weights(self) -> bool:
        return block_quantized(self.model, self.quantization)

    @functools.cached_property
    def dtype_reason(self) -> str:
        """Why :attr:`torch_dtype` is what it is, for the ready line and ``status``."""
        return dtype_reason(self.dtype, self.torch_device, self.block_quantized_weights)

    @functools.cached_property
    def attention_backend_name(self) -> str:
        return resolve_backend_name(self.attention_backend, self.torch_device)

    def __reduce__(self):
        return _rebuilt, (type(self), msgspec.structs.asdict(self), dict(self.__dict__))


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How big the paged KV cache is and whether it shares prefixes (core/kv_cache_manager.py,
    contracts/kv_sizing.py)."""

    block_size: int
    num_kv_blocks: int | None
    kv_cache_bytes: int | None
    kv_cache_memory_fraction: float
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    kv_cache_dtype: str  # "auto" (the model's dtype) or "int8" (attention/kv_cache.py: the bytes per block)


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What one step may hold and in which order requests go (core/scheduler.py)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str
    enable_chunked_prefill: bool
    priority_aging_s: float
    async_scheduling: bool
    # images: placeholder rows of not-yet-encoded images one step may reach (core/encoder_budget.py);
    # None = max_num_batched_tokens
    max_num_encoder_input_tokens: int | None = None


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How many ranks and cores run the model, and how (executor/, worker/, engine/ for DP)."""

    distributed_executor_backend: str  # resolved by EngineConfig: never None here
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    restart_dead_cores: bool
    tp_vocab_parallel: bool
    engine_core_process: bool
    distributed_timeout_s: float
    ray_placement_strategy: str
    num_threads: int | None  # torch intra-op threads of each rank
    enable_expert_parallel: bool  # MoE: each rank holds 1/N of the experts whole (layers/moe.py)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class KVTransferConfig(msgspec.Struct, frozen=True, kw_only=True):
    """KV moved out of the cache: the offload tiers and disaggregated prefill/decode (kv_connector/)."""

    kv_offload_bytes: int | None
    kv_offload_dir: str | None
    kv_offload_dir_bytes: int
    kv_role: str | None
    prefill_cores: int
    decode_cores: int
    pd_skip_hop_below: int
    kv_transfer_dir: str | None
    kv_transfer_lease_s: float
    kv_transfer_transport: str
    kv_transfer_address: str | None

    @property
    def offload_enabled(self) -> bool:
        return self.kv_offload_bytes is not None or self.kv_offload_dir is not None

    @property
    def host_offload_bytes(self) -> int:
        """The host pool's size (a disk tier alone still stages through 512 MiB of it)."""
        return self.kv_offload_bytes if self.kv_offload_bytes is not None else 512 * 2**20


class LoRAConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Multi-LoRA serving: device slots, host LRU and rank bound (lora/, core/lora_admission.py)."""

    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None  # None: max_loras


class MultiModalConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Images: what one prompt may carry (multimodal/) and the worker's encoder cache (worker/)."""

    limit_mm_per_prompt: int
    mm_max_pixels: int
    mm_encoder_cache_tokens: int


# view attribute on EngineConfig -> its type
VIEWS: dict[str, type[msgspec.Struct]] = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "kv_transfer_config": KVTransferConfig,
    "lora_config": LoRAConfig,
    "multimodal_config": MultiModalConfig,
}

# fields parsed into a config object of their own, which the parts read instead of the field
OTHER_HOMES: dict[str, str] = {
    "speculative_config": "config/speculative.py: SpeculativeConfig (EngineConfig.speculative)",
    "limits": "config/request_limits.py: RequestLimits",
    "grammar_limits": "config/grammar_limits.py: GrammarLimits",
}

# fields only the engine's own process/front-end plumbing reads, never a part below engine_core
ENGINE_ONLY: dict[str, str] = {
    "max_queued_requests": "front-end admission (engine/admission.py): the queue before the core",
    "max_queued_tokens": "front-end admission (engine/admission.py): the queue before the core",
    "freeze_gc_after_load": "the engine process's gc policy (engine_core/gc_policy.py)",
}

_S = TypeVar("_S", bound=msgspec.Struct)


def build(view: type[_S], config) -> _S:
    """The view of ``config``: its fields copied by name (the names are EngineConfig's own)."""
    return view(**{name: getattr(config, name) for name in view.__struct_fields__})


def home_of(field: str) -> list[str]:
    """Every home of one EngineConfig field (exactly one is right)."""
    homes = [f"{VIEWS_BY_TYPE[v]} ({v.__name__})" for v in VIEWS.values() if field in v.__struct_fields__]
    homes += [f"OTHER_HOMES ({OTHER_HOMES[field]})"] if field in OTHER_HOMES else []
    return homes + ([f"ENGINE_ONLY ({ENGINE_ONLY[field]})"] if field in ENGINE_ONLY else [])


VIEWS_BY_TYPE = {v: k for k, v in VIEWS.items()}


class SubConfigViews:
    """Mixed into EngineConfig: its typed views, built once each on first use."""

    @functools.cached_property
    def model_config(self) -> ModelConfig:
        return build(ModelConfig, self)

    @functools.cached_property
    def cache_config(self) -> CacheConfig:
        return build(CacheConfig, self)

    @functools.cached_property
    def scheduler_config(self) -> SchedulerConfig:
        return build(SchedulerConfig, self)

    @functools.cached_property
    def parallel_config(self) -> ParallelConfig:
        return build(ParallelConfig, self)

    @functools.cached_property
    def kv_transfer_config(self) -> KVTransferConfig:
        return build(KVTransferConfig, self)

    @functools.cached_property
    def lora_config(self) -> LoRAConfig:
        return build(LoRAConfig, self)

    @functools.cached_property
    def multimodal_config(self) -> MultiModalConfig:
        return build(MultiModalConfig, self)
