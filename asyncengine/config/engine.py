"""EngineConfig: every knob of the engine in one validated place.

Every value is checked at construction, so that a bad one fails there, not mid-request. What depends
on the model (max_model_len, KV bytes per token) is resolved once its config is known
(models/model_info.py, core/kv_sizing.py); what depends on the machine (device, dtype, attention
backend) on first use, in the process that runs the model: this module imports no torch.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from asyncengine.config.attention import (AttentionBackendName, check_backend_name, check_batch_invariant,
                                          check_kv_cache_dtype)
from asyncengine.config.device import (QUANTIZATION_MODES, check_device, check_dtype, check_quantization_device,
                                       resolve_device, resolve_dtype)
from asyncengine.errors import ConfigError
from asyncengine.config.request_limits import RequestLimits
from asyncengine.config.lora import check_lora_limits
from asyncengine.config.multimodal import check_encoder_budget, check_multimodal
from asyncengine.config.runner import check_runner
from asyncengine.config.sub_configs import SubConfigViews

if TYPE_CHECKING:
    import torch

    from asyncengine.config.grammar_limits import GrammarLimits

__all__ = ["EngineConfig", "resolve_device", "resolve_dtype"]


@dataclasses.dataclass
class EngineConfig(SubConfigViews):
    """How the engine runs. Defaults suit a 2-core CPU serving a small model.

    KV cache size: give ``num_kv_blocks`` or ``kv_cache_bytes``; with neither, the cache is sized by
    need (``max_num_seqs`` sequences of ``max_model_len`` tokens), capped at
    ``kv_cache_memory_fraction`` of the memory available at start (``core/kv_sizing.py``). On CPU
    the cache is reserved, not touched: resident memory grows only with the blocks in use.
    Each part reads its typed view (``model_config``, ``cache_config``...: config/sub_configs.py).
    """

    model: str | None = None
    tokenizer: str | None = None  # default: the model folder / GGUF
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.25
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    skip_tokenizer_init: bool = False
    # torch intra-op threads: None = torch's default, lowered while other processes keep cores busy
    # (one CPU worker: worker/cpu_threads.py); a number pins it
    num_threads: int | None = None
    async_scheduling: bool = True  # schedule step N+1 while step N executes
    max_queued_requests: int | None = 4096
    max_queued_tokens: int | None = None
    # priority policy: a waiting request's effective priority improves by 1 every this many seconds
    priority_aging_s: float = 10.0
    # gc paused while loading (~0.2 s of a start), then gc.freeze() of what exists (a full collection
    # stalled the loop ~185 ms mid-serving; docs/benchmarks.md): objects alive then are never
    # cycle-collected; turn it off if your app creates the engine late and cares (engine_core/gc_policy.py)
    freeze_gc_after_load: bool = True
    # what one request may cost (prompt characters, stop strings, n, logprobs, body bytes...):
    # config/request_limits.py; None = RequestLimits()'s documented defaults
    limits: "RequestLimits | None" = None
    # what one structured output may cost (compile time, schema size, enum values, repetition
    # bounds, the compiled-grammar cache's bytes): asyncengine/config/grammar_limits.py; None =
    # GrammarLimits()'s documented defaults
    grammar_limits: "GrammarLimits | None" = None
    # distribution (vLLM's names). The executor runs the model: "uni" = one worker thread in this
    # process, "mp" = tensor_parallel_size x pipeline_parallel_size worker processes, "ray" = Ray
    # actors (pip install asyncengine[ray]); None = "uni" for one rank, else "mp".
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = None
    tensor_parallel_size: int = 1
    # the layers split into this many stages (each tensor_parallel_size ranks); the engine core keeps
    # this many disjoint batches in flight so that every stage has work (docs/pipeline_parallel.md)
    pipeline_parallel_size: int = 1
    # data_parallel_size > 1: that many engine cores, each in its own process with its own
    # scheduler, KV cache and executor, behind one front end that routes each request
    data_parallel_size: int = 1
    # data parallel: a dead core fails only its own requests and the others go on
    # (engine/dp_health.py); True also replaces it with a fresh core process (loads the model again)
    restart_dead_cores: bool = False
    # tensor_parallel_size > 1: embedding and LM head split by vocabulary rows across the ranks
    # (each holds ~1/N of them; one all-reduce and one gather per step), or, False, replicated on
    # every rank with rank 0 alone computing the logits (docs/distributed.md has the measurement)
    tp_vocab_parallel: bool = True
    # AsyncLLMEngine: run the one engine core (schedule -> execute -> update) in its own process,
    # as data_parallel_size > 1 does for each core, so that the model step never waits on the app's
    # own Python for the GIL (a server's HTTP handling, an app's callbacks). The front end (and its
    # event loop) stays in this process. Off by default: in-process is the simple embedded mode.
    engine_core_process: bool = False
    # a collective that waits this long for a peer rank fails (the engine then dies, never hangs)
    distributed_timeout_s: float = 60.0
    # "ray": how the ranks' placement-group bundles go on nodes (PACK, SPREAD, STRICT_PACK,
    # STRICT_SPREAD = one rank per node)
    ray_placement_strategy: str = "PACK"
    # attention over the paged KV cache: "cpu" (C kernels, compiled once per machine: paged decode
    # attention with no gather copy), "torch" (plain torch ops), "triton" (the kernels/ Triton
    # kernels: CUDA, or triton's CPU interpreter under TRITON_INTERPRET=1); "auto" = triton on CUDA,
    # cpu on CPU where the C kernels build, else torch
    attention_backend: AttentionBackendName = "auto"
    # CUDA: the share of the GPU's memory the engine may use; the KV cache gets what is left of it
    # after a profiling run of the largest step (vLLM's name). Ignored when kv_cache_bytes or
    # num_kv_blocks is given.
    gpu_memory_utilization: float = 0.9
    # CUDA: never capture CUDA graphs for decode steps (vLLM's name)
    enforce_eager: bool = False
    # speculative decoding (vLLM's shape): {"method": "ngram", "num_speculative_tokens": 3,
    # "prompt_lookup_min": 1, "prompt_lookup_max": 4} or {"method": "draft_model", "model": path,
    # "num_speculative_tokens": 3}; None = off. Parsed into a SpeculativeConfig.
    speculative_config: dict | None = None
    # weights (docs/quantization.md): None = the checkpoint's own format (a GGUF's Q4_0/Q4_1/Q8_0
    # tensors stay in their blocks and run on the CPU kernels; safetensors load dense); "int8" /
    # "int4" = weight-only quantization of dense weights at load into Q8_0 / Q4_1 blocks (CPU);
    # "none" = dequantize everything at load (the reference the accuracy tests compare with)
    quantization: Literal["none", "int8", "int4"] | None = None
    # how the CPU kernels multiply block-quantized weights (docs/cpu_decode.md): "int8" = each row of
    # activations rounded once to 8-bit blocks of 32 and multiplied with integer dot products
    # (llama.cpp's Q8_0/Q8_1 method; measured perplexity within 1% of llama.cpp's on the same GGUF),
    # "fp32" = activations kept in fp32 (exact up to summation order); "auto" = the process
    # default (ASYNCENGINE_QUANT_ACTIVATIONS, else int8: why, kernels/cpu/quant.py)
    quantized_activations: Literal["auto", "int8", "fp32"] = "auto"
    # every kernel computes each row in an order that does not depend on the batch, the chunk
    # boundaries or the prefix cache, so a request gets bitwise the same tokens and logprobs alone
    # or in any batch (docs/batch_invariance.md: what is guaranteed, what it costs). CPU only.
    batch_invariant: bool = False
    # KV offload (docs/kv_connector.md): a host-memory tier of this many bytes for prefix-cache
    # blocks evicted from the KV cache, and/or a directory that keeps full prompt blocks across
    # restarts (bounded by kv_offload_dir_bytes, least recently used files deleted first; several
    # engines may share it). The disk tier reads through the host pool: with a directory and no
    # kv_offload_bytes the pool gets 512 MiB. None and None = off (today's code path).
    kv_offload_bytes: int | None = None
    kv_offload_dir: str | None = None
    kv_offload_dir_bytes: int = 8 * 2**30
    # disaggregated prefill/decode on one host (docs/kv_connector.md): kv_role makes this core a
    # "prefill" core (it writes each prompt's KV to a transfer file in kv_transfer_dir, shared memory
    # by default) or a "decode" core (it loads a request's transfer file instead of computing its
    # prompt). Files nobody claimed within kv_transfer_lease_s are deleted. The P/D front end
    # (engine/pd_client.py) sets these for the cores it starts.
    kv_role: Literal["prefill", "decode"] | None = None
    # PDEngine (engine/pd_client.py, serve --prefill-cores): this many prefill-only and decode-only
    # cores, each a process (0 and 0: no disaggregation); prompts of fewer tokens than
    # pd_skip_hop_below go straight to a decode core (measured: docs/kv_connector.md)
    prefill_cores: int = 0
    decode_cores: int = 0
    pd_skip_hop_below: int = 0
    kv_transfer_dir: str | None = None
    kv_transfer_lease_s: float = 30.0
    # how the KV moves (kv_connector/pd/transport.py): "shm" files on one host, or "tcp": a prefill
    # core serves its transfers on kv_transfer_address (host:port, set by the front end) and the
    # decode core pulls them, on any host
    kv_transfer_transport: Literal["shm", "tcp"] = "shm"
    kv_transfer_address: str | None = None
    enable_lora: bool = False  # multi-LoRA (docs/lora.md, config/lora.py): the next three are its limits
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None = max_loras
    model_impl: Literal["auto", "native", "transformers"] = "auto"  # Transformers backend: docs/models.md
    enable_expert_parallel: bool = False  # MoE (issue 33): TP ranks hold 1/N of the experts whole
    limit_mm_per_prompt: int = 8  # images (issue 37, docs/multimodal.md): these three; config/multimodal.py
    mm_max_pixels: int = 4096 * 4096  # decoded pixels of one image, checked before it is decoded
    mm_encoder_cache_tokens: int = 8192  # encoder output rows the worker keeps (worker/encoder_cache.py)
    # image encoder budget (issue 37, core/encoder_budget.py): placeholder rows of images not yet
    # encoded that one step may reach; None = max_num_batched_tokens (a larger image goes alone)
    max_num_encoder_input_tokens: int | None = None
    runner: Literal["auto", "generate", "pooling"] = "auto"  # pooling models (issue 34): config/runner.py
    # 8-bit KV cache (issue 39, docs/kv_cache_int8.md): int8 rows + one scale per token per KV head
    kv_cache_dtype: Literal["auto", "int8"] = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ConfigError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.num_kv_blocks is not None and self.kv_cache_bytes is not None:
            raise ConfigError("give num_kv_blocks or kv_cache_bytes, not both")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ConfigError("max_queued_requests must be >= 1 or None")
        if self.max_queued_tokens is not None and self.max_queued_tokens < 1:
            raise ConfigError("max_queued_tokens must be >= 1 or None")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads must be >= 1 or None")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_model_len > self.max_num_batched_tokens:
            raise ConfigError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")
        self.limits = RequestLimits() if self.limits is None else self.limits
        if self.grammar_limits is None:
            from asyncengine.config.grammar_limits import GrammarLimits  # lazy: config stays cheap to import (front ends, the CLI's help)
            self.grammar_limits = GrammarLimits()
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ConfigError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend not in ("uni", "mp", "ray"):
            raise ConfigError(f"distributed_executor_backend must be 'uni', 'mp' or 'ray', "
                              f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ConfigError("distributed_executor_backend='uni' runs one worker thread: "
                              "tensor_parallel_size or pipeline_parallel_size > 1 needs 'mp' or 'ray'")
        if self.distributed_timeout_s <= 0:
            raise ConfigError("distributed_timeout_s must be > 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        from asyncengine.config.speculative import SpeculativeConfig  # lazy: config stays cheap to import (front ends, the CLI's help)
        self.speculative = SpeculativeConfig.from_dict(self.speculative_config)
        if self.speculative is not None and self.world_size > 1:
            raise ConfigError("speculative decoding is not supported with tensor_parallel_size or "
                              "pipeline_parallel_size > 1 yet")
        check_device(self.device)
        check_dtype(self.dtype)
        check_backend_name(self.attention_backend)
        if self.batch_invariant:
            check_batch_invariant(self.device, self.attention_backend)
        check_kv_cache_dtype(self.kv_cache_dtype, self.attention_backend, self.device, self.batch_invariant)
        if self.quantized_activations not in ("auto", "int8", "fp32"):
            raise ConfigError(f"quantized_activations must be 'auto', 'int8' or 'fp32', got {self.quantized_activations!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ConfigError(f"quantization must be one of None (the checkpoint's format), 'none', 'int8' or "
                              f"'int4', got {self.quantization!r}")
        if str(self.device).startswith("cuda"):
            check_quantization_device(self.quantization, "cuda")
        self._check_kv_offload()
        check_lora_limits(self.enable_lora, self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        check_multimodal(self.limit_mm_per_prompt, self.mm_max_pixels, self.mm_encoder_cache_tokens)
        check_encoder_budget(self.max_num_encoder_input_tokens)
        if self.model_impl not in ("auto", "native", "transformers"):  # Transformers backend (issue 32)
            raise ConfigError(f"model_impl must be 'auto', 'native' or 'transformers', got {self.model_impl!r}")
        check_runner(self.runner)

    def _check_kv_offload(self) -> None:
        if self.prefill_cores < 0 or self.decode_cores < 0 or (self.prefill_cores > 0) != (self.decode_cores > 0):
            raise ConfigError(f"prefill_cores and decode_cores are both >= 1 (disaggregated) or both 0, got "
                              f"{self.prefill_cores} and {self.decode_cores}")
        if self.pd_skip_hop_below < 0:
            raise ConfigError(f"pd_skip_hop_below must be >= 0, got {self.pd_skip_hop_below}")
        if self.kv_transfer_transport not in ("shm", "tcp"):
            raise ConfigError(f"kv_transfer_transport must be 'shm' or 'tcp', got {self.kv_transfer_transport!r}")
        if self.prefill_cores and self.distributed_executor_backend == "ray" and self.kv_transfer_transport != "tcp":
            raise ConfigError("P/D cores as Ray actors may run on other nodes: they need kv_transfer_transport='tcp'")
        if self.kv_role not in (None, "prefill", "decode"):
            raise ConfigError(f"kv_role must be None, 'prefill' or 'decode', got {self.kv_role!r}")
        if self.kv_transfer_lease_s <= 0:
            raise ConfigError(f"kv_transfer_lease_s must be > 0, got {self.kv_transfer_lease_s}")
        if self.kv_role is not None and self.tensor_parallel_size > 1:
            raise ConfigError("P/D disaggregation is not supported with tensor_parallel_size > 1 yet")
        if self.kv_offload_bytes is None and self.kv_offload_dir is None:
            return
        if self.kv_offload_bytes is not None and self.kv_offload_bytes <= 0:
            raise ConfigError(f"kv_offload_bytes must be > 0, got {self.kv_offload_bytes}")
        if self.kv_offload_dir_bytes <= 0:
            raise ConfigError(f"kv_offload_dir_bytes must be > 0, got {self.kv_offload_dir_bytes}")
        if not self.enable_prefix_caching:
            raise ConfigError("KV offload extends the prefix cache: it needs enable_prefix_caching=True")
        if self.tensor_parallel_size > 1:
            raise ConfigError("KV offload is not supported with tensor_parallel_size > 1 yet")
        if self.speculative is not None and self.speculative.method == "draft_model":
            raise ConfigError("KV offload is not supported with a draft model yet (its cache would not follow)")

    @property
    def world_size(self) -> int:
        """Worker ranks of one engine core: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    # What depends on the machine (device, dtype, attention backend) is resolved by the model's view,
    # on first use in the process that runs the model (ModelConfig in config/sub_configs.py)
    @property
    def torch_device(self) -> torch.device:
        return self.model_config.torch_device

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.model_config.torch_dtype

    @property
    def block_quantized_weights(self) -> bool:
        return self.model_config.block_quantized_weights

    @property
    def dtype_reason(self) -> str:
        return self.model_config.dtype_reason

    @property
    def attention_backend_name(self) -> str:
        return self.model_config.attention_backend_name
