"""How many KV-cache blocks the engine gets: one policy, a pure function of the configuration, the
model's shape and the memory available (the workers measure the memory and report a KVCacheSpec;
this module only decides, in the engine core).

In order of precedence:

1. ``num_kv_blocks``: exactly that many blocks;
2. ``kv_cache_bytes``: as many blocks as fit in that many bytes;
3. neither (the default): *by need*, what ``max_num_seqs`` sequences at the model's full context
   would use, capped at ``kv_cache_memory_fraction`` of the memory available when the engine starts.

The cache is reserved, not touched: on CPU it is lazily zero-filled anonymous memory
(:func:`asyncengine.attention.kv_cache.kv_cache_zeros`), so the process's resident memory grows
only with the blocks requests actually write to. A generous reservation therefore costs address
space, not RAM, until it is used; a long-running server with prefix caching on keeps freed blocks'
contents and so, over time, touches up to the whole reservation (that is what the cap bounds).
"""
from __future__ import annotations

from dataclasses import dataclass

from asyncengine.config.sub_configs import CacheConfig
from asyncengine.errors import ConfigError


@dataclass(frozen=True)
class KVModelShape:
    """What of the model the KV-cache size depends on."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int  # the longest sequence the engine will serve

    @classmethod
    def of(cls, model_args, max_model_len: int) -> "KVModelShape":
        return cls(model_args.num_layers, model_args.num_kv_heads, model_args.head_dim, max_model_len)


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    bytes_per_block: int
    why: str  # which rule decided, for the log line

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def bytes_per_block(shape: KVModelShape, block_size: int, dtype_bytes: int) -> int:
    """Keys and values of ``block_size`` tokens in every layer."""
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * dtype_bytes


def plan_kv_cache(cache: CacheConfig, max_num_seqs: int, dtype_bytes: int, shape: KVModelShape,
                  available_bytes: int | None) -> KVPlan:
    """The number of KV blocks for the cache view ``cache`` (``EngineConfig.cache_config``), the
    scheduler's ``max_num_seqs`` (the need) and the cache's ``dtype_bytes`` per value.

    ``available_bytes``: memory the cache may come out of (CPU: MemAvailable; GPU: free device
    memory), or None if unknown (then the need alone decides). Raises ConfigError when the result
    holds fewer than 2 blocks."""
    per_block = bytes_per_block(shape, cache.block_size, dtype_bytes)
    return plan_kv_blocks(cache, max_num_seqs, per_block, shape.max_model_len, available_bytes)


def plan_kv_blocks(cache: CacheConfig, max_num_seqs: int, per_block: int, max_model_len: int,
                   available_bytes: int | None, budget_bytes: int | None = None, state_bytes: int = 0) -> KVPlan:
    """:func:`plan_kv_cache` from what one block costs (``per_block`` bytes: on a tensor-parallel
    rank, its share of the KV heads) and the memory available (on the rank with the least; None if
    unknown). ``budget_bytes``: a measured budget that replaces the memory-fraction cap (CUDA: what
    ``gpu_memory_utilization`` leaves after a profiling run). The engine core applies this to the
    :class:`~asyncengine.contracts.kv_cache_spec.KVCacheSpec` its workers report.

    ``state_bytes``: memory the hybrid models' state slots take out of the same budget first (all
    ``max_num_seqs`` slots of every Mamba layer); blocks get the rest. With no attention layers
    (``per_block`` 0) blocks cost nothing and only count tokens: as many as the need."""
    bs = cache.block_size
    need = max_num_seqs * -(-max_model_len // bs) + 1
    if state_bytes:
        _check_states_fit(cache, max_num_seqs, state_bytes, available_bytes, budget_bytes)
    if per_block == 0:
        n = cache.num_kv_blocks if cache.num_kv_blocks is not None else need
        return KVPlan(n, 0, "no attention layers: blocks only count tokens")
    if cache.num_kv_blocks is not None:
        return KVPlan(cache.num_kv_blocks, per_block, "num_kv_blocks")
    if cache.kv_cache_bytes is not None:
        n = (cache.kv_cache_bytes - state_bytes) // per_block
        if n < 2:
            raise ConfigError(f"kv_cache_bytes={cache.kv_cache_bytes} holds fewer than 2 blocks of "
                              f"{per_block} bytes")
        return KVPlan(int(n), per_block, "kv_cache_bytes")
    # (need: +1, the scheduler may hold one block beyond a full-length sequence's while it grows)
    if budget_bytes is not None:
        n = (budget_bytes - state_bytes) // per_block
        if n < 2:
            raise ConfigError(f"the profiled KV budget ({budget_bytes >> 20} MiB) holds fewer than 2 blocks of "
                              f"{per_block} bytes: raise gpu_memory_utilization or lower max_num_batched_tokens")
        return KVPlan(int(min(need, n)), per_block, "profiled budget (gpu_memory_utilization)")
    if available_bytes is None:
        return KVPlan(need, per_block, "max_num_seqs x max_model_len")
    cap = (int(cache.kv_cache_memory_fraction * available_bytes) - state_bytes) // per_block
    if cap < 2:
        raise ConfigError(
            f"kv_cache_memory_fraction={cache.kv_cache_memory_fraction} of the {available_bytes >> 20} MiB "
            f"available holds fewer than 2 KV blocks of {per_block} bytes: free memory, raise the "
            f"fraction or give kv_cache_bytes")
    if need <= cap:
        return KVPlan(need, per_block, "max_num_seqs x max_model_len")
    return KVPlan(cap, per_block, f"{cache.kv_cache_memory_fraction:g} of available memory")


def _check_states_fit(cache: CacheConfig, max_num_seqs: int, state_bytes: int, available_bytes: int | None,
                      budget_bytes: int | None) -> None:
    """ConfigError when the state slots alone exceed the budget they come out of."""
    if cache.kv_cache_bytes is not None:
        limit, what = cache.kv_cache_bytes, f"kv_cache_bytes={cache.kv_cache_bytes}"
    elif budget_bytes is not None:
        limit, what = budget_bytes, f"the profiled budget ({budget_bytes >> 20} MiB)"
    elif available_bytes is not None and cache.num_kv_blocks is None:
        limit = int(cache.kv_cache_memory_fraction * available_bytes)
        what = f"kv_cache_memory_fraction={cache.kv_cache_memory_fraction} of {available_bytes >> 20} MiB"
    else:
        return
    if state_bytes > limit:
        raise ConfigError(f"the state slots of max_num_seqs={max_num_seqs} requests take "
                          f"{state_bytes >> 20} MiB, more than {what}: lower max_num_seqs or give the cache more")


def available_memory_bytes(device) -> int | None:
    """Memory a KV cache on ``device`` (a torch.device) could use now; None if unknown."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    from asyncengine.platforms.host_memory import host_available_bytes  # lazy: reads the machine only when the memory is asked for

    return host_available_bytes()
