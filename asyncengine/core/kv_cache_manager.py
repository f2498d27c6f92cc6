"""KVCacheManager: per-request block tables on top of the block pool, plus prefix-cache lookups.

The scheduler asks it three things: which leading blocks of a new request are already computed
(``get_computed_blocks``), whether ``num_new_tokens`` more slots fit (``allocate_slots``, which
returns the new blocks or None), and to release a request (``free``). It never touches tensors.
"""
from __future__ import annotations

from asyncengine.config.sub_configs import CacheConfig
from asyncengine.contracts.kv_cache_spec import KVCacheConfig
from asyncengine.core.block_pool import BlockPool, KVBlock, hash_block
from asyncengine.core.request import Request


# a table entry that holds no pool block: a sliding-window block that left the window
# (core/sliding_window_kv_cache_manager.py). Its id is 0 so the worker's table keeps its positions;
# the attention masks every key outside the window, so what block 0 holds is read with weight zero.
NULL_BLOCK = KVBlock(0)

class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # prefix-cache counters, in tokens
        self.prefix_queries = 0
        self.prefix_hits = 0
        # called with (request, its blocks, first, end) when blocks [first, end) were just registered
        # in the prefix cache (a KV connector persists them)
        self.on_blocks_cached = None
        # the hash chains' root: None as loaded; new random bytes at each reset_prefix_cache, so no
        # request admitted after it can match a block (or an offloaded copy) computed before
        self.hash_root: bytes | None = None

    @classmethod
    def from_config(cls, plan: KVCacheConfig, cache: CacheConfig) -> KVCacheManager:
        """The engine core's manager: the blocks it planned, prefix caching as the cache view says."""
        return cls(plan.num_blocks, plan.block_size, cache.enable_prefix_caching)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    # ---- hybrid models only (core/hybrid_kv_cache_manager.py): state slots and the n > 1 fork

    def state_slot(self, request_id: str) -> int:
        """The request's state slot; -1: none."""
        return -1

    def plan_fork(self, leader: Request) -> int:
        """Tokens of ``leader``'s prompt its held samples will take over by a fork (0: no fork)."""
        return 0

    def cut_chunk(self, req: Request, num_new_tokens: int) -> int:
        """``num_new_tokens``, or fewer so that a chunk ends at a planned fork point."""
        return num_new_tokens

    def at_fork_point(self, req: Request) -> bool:
        return False

    def take_state_copies(self) -> list[tuple[int, int]]:
        return []

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # ---- models mixing full and sliding layers only (core/grouped_kv_cache_manager.py): groups 1..

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        return []

    def take_new_group_block_ids(self, request_id: str) -> list[list[int]]:
        return []

    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        """Hash the request's full blocks among its first ``num_tokens`` (known) tokens, once each."""
        bs = self.block_size
        hashes = req.block_hashes
        n_full = num_tokens // bs
        while len(hashes) < n_full:
            i = len(hashes)
            start = i * bs
            if start + bs <= req.num_prompt_tokens:
                toks = req.prompt_token_ids[start:start + bs]
            else:
                toks = [req.token_id_at(p) for p in range(start, start + bs)]
            hashes.append(hash_block(hashes[-1] if hashes else self.hash_root, toks, req.block_extra(start, start + bs)))

    def reset_prefix_cache(self, requests) -> None:
        """Forget every cached prefix, also those of blocks running ``requests`` still hold (the
        weights changed: their KV is stale for anyone else). A request holding no block forgets its
        hashes (they chain from the old root); a running one keeps its own, which no newer request
        can compute."""
        import os

        self.hash_root = os.urandom(16)
        for b in self.pool.cached.values():
            b.block_hash = None
        self.pool.cached.clear()
        for req in requests:
            if not self.req_to_blocks.get(req.request_id):
                req.block_hashes.clear()

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of the request. At least the last token
        is always left to compute: its logits are needed to sample."""
        if not self.enable_caching or req.sampling_params.needs_every_prompt_row:
            return [], 0
        n = req.num_tokens
        self._extend_hashes(req, n)
        max_blocks = (n - 1) // self.block_size
        hit: list[KVBlock] = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hit.append(b)
        return hit, len(hit) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once its request is admitted (a request may be looked up many times
        while it waits for room)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def can_fit(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones (and after
        ``new_computed_blocks`` from a prefix hit). Returns the newly allocated blocks, or None (and
        changes nothing) when the pool cannot supply them."""
        bs = self.block_size
        computed = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed) * bs
        self.remove_skipped_blocks(req, num_computed)  # before this step's new blocks: they may reuse them
        total = num_computed + num_new_tokens
        need = -(-total // bs) - len(blocks) - len(computed)
        in_pool = [b for b in computed if b is not NULL_BLOCK]  # a sliding hit's early entries hold none
        # hit blocks sitting in the free queue stop being free once touched
        reclaimed = sum(1 for b in in_pool if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaimed:
            if not blocks:
                del self.req_to_blocks[req.request_id]
            return None
        if computed:
            self.pool.touch(in_pool)
            blocks.extend(computed)
            self._num_cached_blocks[req.request_id] = len(blocks)
        new = self.pool.get_new_blocks(need) if need > 0 else []
        blocks.extend(new)
        if self.enable_caching:
            # register blocks that are full of *known* tokens once this step computes them
            # (in-flight placeholder tokens get registered by a later step, when their ids are known)
            self._cache_full_blocks(req, blocks, min(total, req.num_tokens))
        return new

    def _cache_full_blocks(self, req: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        n_full = num_tokens // self.block_size
        start = self._num_cached_blocks.get(req.request_id, 0)
        if n_full <= start:
            return
        self._extend_hashes(req, n_full * self.block_size)
        for i in range(start, n_full):
            if blocks[i] is not NULL_BLOCK:  # async scheduling may register a block after it left the window
                self.pool.cache_block(blocks[i], req.block_hashes[i])
        self._num_cached_blocks[req.request_id] = n_full
        if self.on_blocks_cached is not None:
            self.on_blocks_cached(req, blocks, start, n_full)

    def uncache_unscheduled(self, req: Request) -> bool:
        """``req`` is being taken back out of the step being built (preempted for another request):
        forget the hashes ``allocate_slots`` registered for blocks that only this step would have
        filled, since their KV will never be written. Returns False and changes nothing when one of
        them is already shared by a prefix hit made in this step (that request relies on this step
        writing it): then ``req`` must stay scheduled."""
        blocks = self.req_to_blocks.get(req.request_id)
        if not blocks:
            return True
        first = req.num_computed_tokens // self.block_size  # blocks before it were written earlier
        end = self._num_cached_blocks.get(req.request_id, 0)
        fresh = [b for b in blocks[first:end] if b.block_hash is not None]
        if any(b.ref_cnt > 1 for b in fresh):
            return False
        for b in fresh:
            self.pool.uncache_block(b)
        if end > first:
            self._num_cached_blocks[req.request_id] = first
        return True

    def free(self, req: Request) -> None:
        blocks = self.req_to_blocks.pop(req.request_id, None)
        self._num_cached_blocks.pop(req.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed([b for b in blocks if b is not NULL_BLOCK]))

    def remove_skipped_blocks(self, req: Request, position: int) -> None:
        """Free the request's blocks no query at ``position`` or later reads: none under full
        attention (the sliding-window manager overrides it)."""

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
