"""The two messages of KV-cache sizing, between the engine core and its workers (vLLM:
kv_cache_interface.py): each worker reports a :class:`KVCacheSpec` (what a block of ``block_size``
tokens costs on its rank, what memory it could give), the core plans the cache (core/kv_sizing.py)
and hands every worker one :class:`KVCacheConfig`, which the worker builds as given. A module of its
own, below both: the core and the worker import it, neither imports the other for it."""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from asyncengine.config.speculative import SpeculativeConfig
    from asyncengine.config.sub_configs import KVTransferConfig, ParallelConfig


class KVCacheSpec(msgspec.Struct, kw_only=True):
    """What one rank reports before the core sizes the KV cache."""

    block_size: int  # tokens per block, the unit bytes_per_block prices
    bytes_per_block: int  # this rank's share of one block (its KV heads only)
    available_bytes: int | None  # memory the rank could give the cache (None: unknown)
    # CUDA: what gpu_memory_utilization leaves for the cache after a profiling run (None: not measured)
    kv_budget_bytes: int | None = None
    # hybrid models: one request's state slot over all its Mamba layers (0: no state layers)
    state_bytes_per_seq: int = 0
    # the target model's share of bytes_per_block (a draft model's cache adds its own to a block):
    # what a KV connector moves per block (0: all of bytes_per_block)
    target_bytes_per_block: int = 0
    # per attention layer: its sliding window in tokens (None: full attention); empty: unknown / none
    layer_windows: tuple[int | None, ...] = ()

    @property
    def connector_bytes_per_block(self) -> int:
        return self.target_bytes_per_block or self.bytes_per_block


class KVCacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What the core decided: every rank allocates ``num_blocks`` blocks of ``block_size`` tokens."""

    num_blocks: int
    block_size: int


class KVCacheGroup(msgspec.Struct, frozen=True, kw_only=True):
    """Layers that share one block table: every attention layer with the same window (vLLM's
    kv_cache_interface.py groups by spec the same way)."""

    sliding_window: int | None  # None: full attention (every block stays while the request runs)
    layers: tuple[int, ...]


def kv_cache_groups(layer_windows) -> list[KVCacheGroup]:
    """One group per attention kind, full first, then the windows in ascending order. A model
    declares each layer's ``sliding_window`` (None = full); this is the only place they are grouped."""
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        kinds.setdefault(w, []).append(i)
    order = sorted(kinds, key=lambda w: -1 if w is None else w)
    return [KVCacheGroup(sliding_window=w, layers=tuple(kinds[w])) for w in order]


def block_table_groups(layer_windows) -> list[KVCacheGroup]:
    """The block tables of a model mixing attention kinds (vLLM's hybrid allocator): each kind's
    layers cut into groups of ``size`` layers, ``size`` the smallest kind's layer count (a kind's
    last group may be short). Each group has its own block table; layer ``j`` of every group uses
    the same cache tensor ``j``, so a pool block costs ``size`` layers' worth and one id serves one
    group. One kind only: one group of every layer (the single-table layout)."""
    kinds = kv_cache_groups(layer_windows)
    if len(kinds) <= 1:
        return kinds
    size = min(len(k.layers) for k in kinds)
    return [KVCacheGroup(sliding_window=k.sliding_window, layers=k.layers[i:i + size])
            for k in kinds for i in range(0, len(k.layers), size)]



def one_table_reason(speculative: SpeculativeConfig | None, kv_transfer: KVTransferConfig,
                     parallel: ParallelConfig) -> str | None:
    """Why a model mixing full and sliding layers keeps one table with every block (None: a table
    per group): what moves or reads whole tables, or holds only some layers."""
    if speculative is not None:
        return "speculative decoding (a draft model reads the target's table)"
    if kv_transfer.offload_enabled or kv_transfer.kv_role is not None:
        return "KV offload / P/D disaggregation (they move one table's blocks)"
    if parallel.pipeline_parallel_size > 1:
        return "pipeline parallelism (each stage holds some layers)"
    return None


def table_groups(layer_windows, one_table: str | None) -> list[KVCacheGroup]:
    """The block tables an engine keeps, the one decision the core and the workers share: per
    group (:func:`block_table_groups`), or one full table over every layer when ``one_table``
    (:func:`one_table_reason`'s answer for the engine) gives a reason."""
    groups = block_table_groups(layer_windows)
    if len(groups) > 1 and one_table:
        return [KVCacheGroup(sliding_window=None, layers=tuple(range(len(layer_windows))))]
    return groups
