"""The KV-cache manager of a model mixing full and sliding-window layers (Gemma 2/3, Qwen2 with
``max_window_layers``): one block table per group (vLLM's hybrid allocator:
kv_cache_coordinator.py over single_type_kv_cache_manager.py).

``contracts.kv_cache_spec.block_table_groups`` cuts the layers into groups of equal size; each
group keeps its own table, drawn from one shared pool (layer ``j`` of every group uses the same
cache tensor ``j`` on the worker, so one pool block is one group's block). A full group keeps every
block while its request runs; a sliding group frees the blocks that left its window (the
:class:`SlidingWindowKVCacheManager` rule), so a long request holds about ``w / bs + 2`` blocks per
sliding group instead of one per position.

Each group is a plain or sliding manager on a view of the shared pool whose prefix-cache hashes
carry the group's index: the same prefix is cached once per group (different layers' KV). A prefix
hit is the longest that *every* group serves (a full group: every block before it; a sliding one:
the blocks of the window before its end). Group 0's table is the request's ``block_ids`` (what
the scheduler and its message always carried); the others travel beside it
(``NewRequestData.group_block_ids``, ``CachedRequestData.new_group_block_ids``).
"""
from __future__ import annotations

import logging

from asyncengine.config.speculative import SpeculativeConfig
from asyncengine.config.sub_configs import CacheConfig, KVTransferConfig, ParallelConfig, SchedulerConfig
from asyncengine.contracts.kv_cache_spec import block_table_groups, one_table_reason, table_groups
from asyncengine.core.block_pool import BlockPool, KVBlock
from asyncengine.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from asyncengine.core.request import Request
from asyncengine.core.sliding_window_kv_cache_manager import SlidingWindowKVCacheManager, check_sliding_config
from asyncengine.core.sliding_window_kv_cache_manager import max_request_len as one_table_len
from asyncengine.errors import ConfigError

log = logging.getLogger(__name__)


class _GroupPool:
    """The shared pool as one group sees it: its prefix-cache keys end with the group's tag."""

    def __init__(self, pool: BlockPool, tag: bytes) -> None:
        self._pool = pool
        self._tag = tag

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._pool.get_cached_block(block_hash + self._tag)

    def cache_block(self, b: KVBlock, block_hash: bytes) -> None:
        self._pool.cache_block(b, block_hash + self._tag)


class GroupedHit(list):
    """A prefix hit over every group: as a list, group 0's blocks (what the scheduler hands back
    to ``allocate_slots``); ``groups`` holds every group's."""

    def __init__(self, groups: list[list[KVBlock]]) -> None:
        super().__init__(groups[0] if groups else ())
        self.groups = groups


class GroupedKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, windows: list[int | None],
                 enable_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        if len(windows) < 2:
            raise ConfigError(f"a grouped KV cache needs two groups or more, got windows {windows}")
        self.windows = list(windows)
        self.groups: list[KVCacheManager] = []
        for g, w in enumerate(windows):
            sub = (KVCacheManager(0, block_size, enable_caching) if w is None
                   else SlidingWindowKVCacheManager(0, block_size, w, enable_caching))
            sub.pool = _GroupPool(self.pool, bytes([g]) if g else b"")
            self.groups.append(sub)
        self.req_to_blocks = self.groups[0].req_to_blocks  # the table the scheduler's message carries
        self._fresh: dict[str, list[list[int]]] = {}  # groups 1..: ids allocated since the last message

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """Groups 1..'s whole tables (a request the worker sees anew); forgets the fresh ids."""
        self._fresh.pop(request_id, None)
        return [sub.block_ids(request_id) for sub in self.groups[1:]]

    def take_new_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Groups 1..'s ids allocated since the request's last message."""
        return self._fresh.pop(request_id, None) or [[] for _ in self.groups[1:]]

    def held_blocks(self, request_id: str, group: int) -> int:
        """Pool blocks the request holds in ``group`` (freed, out-of-window entries not counted)."""
        return sum(1 for b in self.groups[group].req_to_blocks.get(request_id, ()) if b is not NULL_BLOCK)

    def _served(self, g: int, found: list[KVBlock | None], hit: int) -> list[KVBlock] | None:
        """Group ``g``'s table for a hit of ``hit`` blocks, or None when it cannot serve it."""
        sub = self.groups[g]
        first = sub.first_kept_block(hit * self.block_size) if self.windows[g] is not None else 0
        if any(b is None for b in found[first:hit]):
            return None
        return [NULL_BLOCK] * first + found[first:hit]

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest hit every group serves (at least the last token is left to compute)."""
        if not self.enable_caching or req.sampling_params.needs_every_prompt_row:
            return [], 0
        n = req.num_tokens
        self._extend_hashes(req, n)
        max_blocks = (n - 1) // self.block_size
        hashes = req.block_hashes[:max_blocks]
        found = [[sub.pool.get_cached_block(h) for h in hashes] for sub in self.groups]
        top = max_blocks
        for g, w in enumerate(self.windows):  # a full group serves its leading cached run only
            if w is None:
                top = min(top, next((i for i, b in enumerate(found[g]) if b is None), max_blocks))
        for hit in range(top, 0, -1):
            tables = [self._served(g, found[g], hit) for g in range(len(self.groups))]
            if all(t is not None for t in tables):
                return GroupedHit(tables), hit * self.block_size
        return [], 0

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> list[KVBlock] | None:
        """Every group's blocks for ``num_new_tokens`` more tokens, or none (None, nothing taken).
        Returns group 0's new blocks; the other groups' ids wait for the step's message."""
        bs, rid = self.block_size, req.request_id
        hits = getattr(new_computed_blocks, "groups", None) or [[] for _ in self.groups]
        num_computed = req.num_computed_tokens + len(hits[0]) * bs
        for sub in self.groups:  # before the new blocks: they may reuse what leaves a window
            sub.remove_skipped_blocks(req, num_computed)
        total_blocks = -(-(num_computed + num_new_tokens) // bs)
        need = reclaimed = 0
        for sub, hit in zip(self.groups, hits):
            need += max(0, total_blocks - len(sub.req_to_blocks.get(rid, ())) - len(hit))
            reclaimed += sum(1 for b in hit if b is not NULL_BLOCK and b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaimed:
            return None
        # hold every group's hit blocks before any group takes new ones: a free cached block one
        # group hits must not be evicted for another group's new blocks
        held = [b for hit in hits for b in hit if b is not NULL_BLOCK]
        self.pool.touch(held)
        news = [sub.allocate_slots(req, num_new_tokens, hit) for sub, hit in zip(self.groups, hits)]
        self.pool.free_blocks(held)  # each group took its own reference
        assert all(new is not None for new in news), "a group's allocation failed after the pool check"
        fresh = self._fresh.setdefault(rid, [[] for _ in self.groups[1:]])
        for ids, new in zip(fresh, news[1:]):
            ids.extend(b.block_id for b in new)
        return news[0]

    def uncache_unscheduled(self, req: Request) -> bool:
        """All groups or none: False (nothing changed) when a group's fresh block is shared."""
        first = req.num_computed_tokens // self.block_size
        for sub in self.groups:
            end = sub._num_cached_blocks.get(req.request_id, 0)
            blocks = sub.req_to_blocks.get(req.request_id, [])
            if any(b.block_hash is not None and b.ref_cnt > 1 for b in blocks[first:end]):
                return False
        return all([sub.uncache_unscheduled(req) for sub in self.groups])

    def free(self, req: Request) -> None:
        for sub in self.groups:
            sub.free(req)
        self._fresh.pop(req.request_id, None)

    def reset_prefix_cache(self, requests) -> None:
        super().reset_prefix_cache(requests)
        for sub in self.groups:
            sub.hash_root = self.hash_root

    def max_request_len(self, sched: SchedulerConfig, model_len: int) -> int:
        """The longest request whose blocks in every group fit the whole cache at once (a sliding
        group holds a chunk and its window at most, under chunked prefill)."""
        bs = self.block_size

        def need(tokens: int) -> int:
            chunk = sched.max_num_batched_tokens if sched.enable_chunked_prefill else tokens
            return sum(-(-tokens // bs) if w is None else min(-(-tokens // bs), -(-(chunk + w) // bs) + 2)
                       for w in self.windows)

        lo, hi = 0, model_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if need(mid) <= self.pool.num_blocks else (lo, mid - 1)
        return lo

    def group_stats(self) -> dict:
        """Scalars (the stats feed metrics): the group count and blocks held by the sliding groups."""
        sliding = [sub for sub, w in zip(self.groups, self.windows) if w is not None]
        return {"kv_cache_groups": len(self.groups),
                "kv_sliding_group_blocks": sum(1 for sub in sliding for blocks in sub.req_to_blocks.values()
                                               for b in blocks if b is not NULL_BLOCK)}


def make_kv_cache_manager(cache: CacheConfig, layer_windows, num_blocks: int, *,
                          speculative: SpeculativeConfig | None, kv_transfer: KVTransferConfig,
                          parallel: ParallelConfig) -> KVCacheManager:
    """The manager for a model without state layers, by its attention kinds: all full -> the plain
    one; all sliding over one window -> :class:`SlidingWindowKVCacheManager`; mixed -> one table
    per group (:class:`GroupedKVCacheManager`), or one plain table when what the engine runs needs
    one (``contracts.kv_cache_spec.one_table_reason``, hence the speculative, KV-transfer and
    parallel views: speculative decoding, KV offload, P/D, pipeline parallelism)."""
    one_table = one_table_reason(speculative, kv_transfer, parallel)
    groups = table_groups(layer_windows, one_table)
    caching = cache.enable_prefix_caching
    if len(groups) == 1 and groups[0].sliding_window is not None:
        check_sliding_config(speculative, kv_transfer)
        return SlidingWindowKVCacheManager(num_blocks, cache.block_size, groups[0].sliding_window, caching)
    if len(block_table_groups(layer_windows)) > len(groups):
        log.info("KV cache: a model mixing full and sliding layers keeps one table with every block under %s",
                 one_table)
    if len(groups) > 1:
        log.info("KV cache: %d block tables of %d layers each (%s)", len(groups), len(groups[0].layers),
                 ", ".join(f"window {g.sliding_window}: layers {list(g.layers)}" for g in groups))
        return GroupedKVCacheManager(num_blocks, cache.block_size, [g.sliding_window for g in groups], caching)
    return KVCacheManager(num_blocks, cache.block_size, caching)


def max_request_len(kv: KVCacheManager, sched: SchedulerConfig, num_blocks: int, model_len: int) -> int:
    """The longest request the cache serves (core/sliding_window_kv_cache_manager.py for one table)."""
    if isinstance(kv, GroupedKVCacheManager):
        return kv.max_request_len(sched, model_len)
    return one_table_len(kv, sched, num_blocks, model_len)
