"""BlockPool + KVCacheManager: property tests over random allocate / append / free sequences, and
focused unit tests of the pieces (free queue, all-or-nothing allocation, prefix hits, cache salt).

The state machine drives the manager the way the scheduler does (prefix lookup on admission,
``allocate_slots`` per chunk, ``free`` at the end) over requests that share prefixes, with a pool
small enough that allocation fails and cached blocks get evicted. Next to the real pool it keeps a
model: which blocks each request holds, the order blocks were freed in, and what "KV" each slot
holds (the token prefix that produced it). After every step:

* ``pool.check_invariants()``;
* each block's ref_cnt == the number of block tables holding it (so a block shared by two requests
  is counted by both), free + referenced == total, and the free queue holds exactly ref_cnt == 0;
* every cached hash maps to a block carrying that hash, and a prefix hit only ever serves blocks
  whose every slot was written by the same token prefix (and the same cache salt);
* the free queue is in LRU order: exactly the model's order (tail = most recently freed), and new
  blocks always come from its head (the least recently freed cached block is evicted first).
At the end every request is freed and every block is free.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant,
                                 multiple, precondition, rule, run_state_machine_as_test)

from asyncengine.core.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block
from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.request import Request
from asyncengine.sampling_params import SamplingParams

BS = 4
# Prompts are prefix + middle + tail: shared beginnings of different lengths, then contents that recur
# after different prefixes (so an unchained hash would serve the wrong KV), then a short random tail.
PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [11, 12, 13, 14, 21, 22, 23], [41, 42, 43, 44], []]
MIDDLES = [[3, 3, 3, 3, 3], [3, 3, 3, 3, 4, 4, 4, 4, 5], [4, 4], [5]]


def make_req(rid: str, prompt: list[int], salt: str | None = None, max_tokens: int = 8) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   max_tokens=max_tokens, cache_salt=salt)


def pool_snapshot(kv: KVCacheManager):
    p = kv.pool
    return ([b.block_id for b in p.free_queue], [(b.ref_cnt, b.block_hash) for b in p.blocks],
            dict(p.cached), {k: list(v) for k, v in kv.req_to_blocks.items()}, dict(kv._num_cached_blocks),
            p.num_free_blocks, p.num_evictions)


# what the machine exercised, summed over a whole hypothesis run
SEEN = {"admitted": 0, "hits": 0, "evictions": 0, "failed_allocations": 0, "finished": 0, "steps": 0}


class KVCacheMachine(RuleBasedStateMachine):
    """Requests arrive (sharing prefixes), compute in chunks, sample tokens, and finish."""

    reqs = Bundle("reqs")

    @initialize(num_blocks=st.integers(3, 12), caching=st.booleans())
    def setup(self, num_blocks, caching):
        self.kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
        self.caching = caching
        self.live: dict[str, Request] = {}
        self.free_order = list(range(num_blocks))  # model of the free queue, head first
        self.slot_kv: dict[tuple[int, int], tuple] = {}  # (block, slot) -> (salt, token prefix) written there
        self.n = 0

    # ---------------------------------------------------------------- helpers

    def _take(self, hit, new):
        for b in hit:
            if b.block_id in self.free_order:  # a free cached block revived by a hit
                self.free_order.remove(b.block_id)
        for b in new:
            assert b.block_id == self.free_order.pop(0), "new blocks must come from the LRU head"

    def _write(self, req: Request, start: int, end: int) -> None:
        """The 'model' computes positions [start, end): record what each slot now holds."""
        table = self.kv.req_to_blocks[req.request_id]
        toks = req.all_token_ids
        for pos in range(start, end):
            self.slot_kv[(table[pos // BS].block_id, pos % BS)] = (req.cache_salt, tuple(toks[:pos + 1]))

    def _compute(self, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        self._write(req, start, start + n)
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:  # reached the end: "sample" a token
            req.output_token_ids.append(40 + len(req.output_token_ids) % 3)

    # ---------------------------------------------------------------- rules

    @precondition(lambda self: len(self.live) < 4)
    @rule(target=reqs, prefix=st.sampled_from(PREFIXES), middle=st.sampled_from(MIDDLES),
          tail=st.lists(st.integers(3, 4), max_size=3), salt=st.sampled_from([None, None, "tenant-a"]),
          first_chunk=st.integers(1, 16))
    def arrive(self, prefix, middle, tail, salt, first_chunk):
        self.n += 1
        req = make_req(f"r{self.n}", prefix + middle + tail, salt)
        before = pool_snapshot(self.kv)
        hit, num_hit = self.kv.get_computed_blocks(req)
        assert num_hit == len(hit) * BS and num_hit < req.num_tokens
        if not self.caching:
            assert not hit
        for i, b in enumerate(hit):  # a hit serves exactly the KV of this token prefix (and salt)
            assert b.block_hash == req.block_hashes[i] and self.kv.pool.cached[b.block_hash] is b
            for s in range(BS):
                assert self.slot_kv.get((b.block_id, s)) == (salt, tuple(req.all_token_ids[:i * BS + s + 1]))
        n = min(first_chunk, req.num_tokens - num_hit)
        evictions = self.kv.pool.num_evictions
        new = self.kv.allocate_slots(req, n, hit)
        if new is None:
            assert pool_snapshot(self.kv) == before, "a failed allocation changed the pool"
            SEEN["failed_allocations"] += 1
            return multiple()  # never admitted: no handle
        SEEN["admitted"] += 1
        SEEN["hits"] += len(hit)
        SEEN["evictions"] += self.kv.pool.num_evictions - evictions
        self._take(hit, new)
        req.num_computed_tokens = num_hit
        self._compute(req, n)
        self.live[req.request_id] = req
        return req

    @rule(req=reqs, chunk=st.integers(1, 9))
    def step(self, req, chunk):
        if req.request_id not in self.live:
            return
        todo = req.num_tokens - req.num_computed_tokens
        if todo == 0 or len(req.output_token_ids) >= req.max_tokens:
            return
        n = min(chunk, todo)
        before = pool_snapshot(self.kv)
        new = self.kv.allocate_slots(req, n)
        if new is None:
            assert pool_snapshot(self.kv) == before, "a failed allocation changed the pool"
            return
        self._take([], new)
        self._compute(req, n)
        SEEN["steps"] += 1

    @rule(req=consumes(reqs))
    def finish(self, req):
        if req.request_id not in self.live:
            return
        table = list(self.kv.req_to_blocks.get(req.request_id, []))
        refs = {b.block_id: b.ref_cnt for b in table}
        self.kv.free(req)
        del self.live[req.request_id]
        SEEN["finished"] += 1
        for b in reversed(table):  # deepest block first
            refs[b.block_id] -= 1
            if refs[b.block_id] == 0:
                self.free_order.append(b.block_id)

    @precondition(lambda self: not self.live)
    @rule()
    def reset_cache(self):
        assert self.kv.pool.reset_prefix_cache()
        assert not self.kv.pool.cached and all(b.block_hash is None for b in self.kv.pool.blocks)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def pool_consistent(self):
        kv, pool = self.kv, self.kv.pool
        pool.check_invariants()
        holders: dict[int, int] = {}
        for rid, table in kv.req_to_blocks.items():
            assert rid in self.live
            assert len({b.block_id for b in table}) == len(table), "a block twice in one table"
            for b in table:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0), f"{b}: ref_cnt != tables holding it"
        referenced = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.num_free_blocks + referenced == pool.num_blocks
        assert [b.block_id for b in pool.free_queue] == self.free_order, "free queue is not in LRU order"
        if not self.caching:
            assert not pool.cached
        for h, b in pool.cached.items():
            assert b.block_hash == h
        for rid, req in self.live.items():  # every request has room for exactly what it computed
            table = kv.req_to_blocks[rid]
            assert len(table) == -(-req.num_computed_tokens // kv.block_size)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for req in list(self.live.values()):
            self.kv.free(req)
        self.live.clear()
        self.kv.pool.check_invariants()
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)
        assert not self.kv.req_to_blocks


def test_kv_cache_state_machine():
    """Runs the machine; the generated workloads must really hit, evict and fail to allocate."""
    for k in SEEN:
        SEEN[k] = 0
    run_state_machine_as_test(KVCacheMachine, settings=settings(
        max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
    assert SEEN["hits"] > 0 and SEEN["evictions"] > 0 and SEEN["failed_allocations"] > 0, SEEN


# ---------------------------------------------------------------------------- focused unit tests


def test_free_queue_remove_from_middle_is_o1():
    blocks = [KVBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[3])
    assert [b.block_id for b in q] == [0, 1, 2, 4, 5] and q.num_free == 5
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    assert blocks[2].next_free is blocks[4] and blocks[4].prev_free is blocks[2]
    q.append(blocks[3])
    assert [b.block_id for b in q] == [0, 1, 2, 4, 5, 3]
    assert q.popleft() is blocks[0] and q.num_free == 5
    q.remove(blocks[3])  # the tail
    q.remove(blocks[1])  # the head
    assert [b.block_id for b in q] == [2, 4, 5] and q.num_free == 3
    with pytest.raises(AssertionError):
        q.remove(blocks[1])  # not in the queue any more

    # O(1): removing 2k blocks from the middle of a 20k queue touches neighbours only. Counted, not
    # timed: every read or write of a free-queue link is tallied, and each removal may touch only
    # the removed block's and its two neighbours' links, a constant count (a scan would touch thousands)
    touched = [0]

    class CountingBlock(KVBlock):
        __slots__ = ()

        def __getattribute__(self, name):
            if name in ("prev_free", "next_free"):
                touched[0] += 1
            return object.__getattribute__(self, name)

        def __setattr__(self, name, value):
            if name in ("prev_free", "next_free"):
                touched[0] += 1
            object.__setattr__(self, name, value)

    big = [CountingBlock(i) for i in range(20_000)]
    bq = FreeBlockQueue(big)
    FreeBlockQueue.__iter__, saved = None, FreeBlockQueue.__iter__  # removal must never iterate
    try:
        touched[0] = 0
        for b in big[9_000:11_000]:
            bq.remove(b)
    finally:
        FreeBlockQueue.__iter__ = saved
    assert bq.num_free == 18_000 and 0 < touched[0] <= 16 * 2_000, touched[0]
    assert big[8_999].next_free is big[11_000]


def test_free_queue_empty_pop():
    q = FreeBlockQueue([])
    with pytest.raises(IndexError):
        q.popleft()


def test_double_free_fails_loudly():
    """A reference dropped twice is a bookkeeping bug: it must fail at once, not put a block that
    someone still reads into the free queue."""
    pool = BlockPool(3)
    b, _ = pool.get_new_blocks(2)
    pool.touch([b])  # two references
    pool.free_blocks([b, b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 2
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([b])


def test_cache_block_registers_once_and_only_with_caching_on():
    """A registered block keeps its first hash (another hash for it is ignored, the map stays exact),
    and a pool without caching registers nothing."""
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, b"h1" * 16)
    pool.cache_block(b, b"h2" * 16)
    assert b.block_hash == b"h1" * 16 and pool.get_cached_block(b"h2" * 16) is None
    pool.check_invariants()
    off = BlockPool(3, enable_caching=False)
    (c,) = off.get_new_blocks(1)
    off.cache_block(c, b"h1" * 16)
    assert c.block_hash is None and not off.cached


def test_allocate_slots_all_or_nothing():
    kv = KVCacheManager(4, BS)
    a = make_req("a", list(range(3, 3 + 10)))  # 3 blocks
    assert len(kv.allocate_slots(a, 10)) == 3
    a.num_computed_tokens = 10
    b = make_req("b", list(range(100, 109)))  # needs 3 blocks, 1 free
    before = pool_snapshot(kv)
    assert kv.allocate_slots(b, 9) is None
    assert pool_snapshot(kv) == before and "b" not in kv.req_to_blocks
    # growing a running request past the pool fails the same way, keeping its table
    before = pool_snapshot(kv)
    assert kv.allocate_slots(a, 7) is None  # 17 tokens = 5 blocks > 4
    assert pool_snapshot(kv) == before
    assert len(kv.allocate_slots(a, 6)) == 1  # 16 tokens = 4 blocks: exactly fits
    assert kv.num_free_blocks == 0
    kv.free(a)
    assert kv.num_free_blocks == 4


def test_allocate_slots_counts_revived_hit_blocks():
    """Hit blocks sitting in the free queue stop being free when touched: they are not room for new ones."""
    kv = KVCacheManager(4, BS)
    a = make_req("a", list(range(3, 12)))  # 9 tokens: 2 full blocks cached, 3 blocks used
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.free(a)
    assert kv.num_free_blocks == 4 and len(kv.pool.cached) == 2
    b = make_req("b", list(range(3, 11)) + list(range(50, 60)))  # hits 2 blocks, needs 3 more (18 tokens)
    hit, n = kv.get_computed_blocks(b)
    assert n == 8 and len(hit) == 2
    before = pool_snapshot(kv)
    assert kv.allocate_slots(b, b.num_tokens - n, hit) is None  # 2 revived + 3 new > 4
    assert pool_snapshot(kv) == before
    c = make_req("c", list(range(3, 11)) + list(range(50, 58)))  # 16 tokens: hits 2, needs 2 more
    hit, n = kv.get_computed_blocks(c)
    new = kv.allocate_slots(c, c.num_tokens - n, hit)
    assert len(new) == 2 and kv.num_free_blocks == 0
    assert kv.req_to_blocks["c"][:2] == hit and all(h.ref_cnt == 1 for h in hit)
    kv.free(c)
    kv.pool.check_invariants()
    assert kv.num_free_blocks == 4


def test_full_prompt_hit_leaves_last_token():
    kv = KVCacheManager(16, BS)
    prompt = list(range(3, 3 + 2 * BS))  # exactly two blocks
    a = make_req("a", prompt)
    kv.allocate_slots(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    kv.free(a)
    assert len(kv.pool.cached) == 2
    b = make_req("b", prompt)
    hit, n = kv.get_computed_blocks(b)
    assert n == BS and len(hit) == 1, "the whole prompt was served: nothing left to sample from"
    assert kv.allocate_slots(b, len(prompt) - n, hit) is not None
    assert len(kv.req_to_blocks["b"]) == 2
    # one more token and both blocks can be served
    c = make_req("c", prompt + [99])
    hit, n = kv.get_computed_blocks(c)
    assert n == 2 * BS and hit == kv.req_to_blocks["b"][:1] + [kv.pool.cached[c.block_hashes[1]]]


def test_cache_salt_separates_tenants():
    kv = KVCacheManager(16, BS)
    prompt = list(range(3, 3 + 3 * BS + 1))
    a = make_req("a", prompt, salt="tenant-a")
    kv.allocate_slots(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    kv.free(a)
    for rid, salt, expect in (("b", "tenant-b", 0), ("c", None, 0), ("d", "tenant-a", 3 * BS)):
        _, n = kv.get_computed_blocks(make_req(rid, prompt, salt=salt))
        assert n == expect, (salt, n)
    assert hash_block(None, prompt[:BS], "x") != hash_block(None, prompt[:BS], None)
    assert hash_block(None, prompt[:BS], "x") == hash_block(None, prompt[:BS], "x")


def test_chained_hash_depends_on_whole_prefix():
    """The same block content after a different prefix is a different cache entry."""
    kv = KVCacheManager(16, BS)
    a = make_req("a", [5, 5, 5, 5, 7, 7, 7, 7, 9])
    b = make_req("b", [6, 6, 6, 6, 7, 7, 7, 7, 9])
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    hit, n = kv.get_computed_blocks(b)
    assert n == 0 and a.block_hashes[1] != b.block_hashes[1]


def test_lru_eviction_order():
    """Freed cached blocks are evicted least recently freed first; a request's deepest block goes first."""
    kv = KVCacheManager(6, BS)
    reqs = []
    for i, base in enumerate((100, 200, 300)):
        r = make_req(f"r{i}", list(range(base, base + 2 * BS)))  # 2 full blocks each, all 6 used
        kv.allocate_slots(r, 2 * BS)
        r.num_computed_tokens = 2 * BS
        reqs.append(r)
    tables = {r.request_id: list(kv.req_to_blocks[r.request_id]) for r in reqs}
    for r in (reqs[1], reqs[0], reqs[2]):  # free order: r1, r0, r2
        kv.free(r)
    expect = [tables[r][i].block_id for r in ("r1", "r0", "r2") for i in (1, 0)]
    assert [b.block_id for b in kv.pool.free_queue] == expect
    assert len(kv.pool.cached) == 6
    # a hit on r0's first block takes it out of the middle; new blocks evict from the head
    x = make_req("x", list(range(100, 100 + BS)) + [1, 2, 3, 4, 5])
    hit, n = kv.get_computed_blocks(x)
    assert hit == [tables["r0"][0]]
    new = kv.allocate_slots(x, x.num_tokens - n, hit)
    assert [b.block_id for b in new] == expect[:2]  # r1's deep block, then r1's first block
    assert kv.pool.num_evictions == 2
    assert kv.pool.get_cached_block(reqs[1].block_hashes[0]) is None
    assert kv.pool.get_cached_block(reqs[2].block_hashes[0]) is tables["r2"][0]  # freed last: kept
    kv.free(x)
    kv.pool.check_invariants()


def test_no_caching_pool_never_hashes():
    kv = KVCacheManager(8, BS, enable_caching=False)
    prompt = list(range(3, 3 + 3 * BS))
    a = make_req("a", prompt)
    kv.allocate_slots(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    kv.free(a)
    b = make_req("b", prompt)
    assert not kv.pool.cached and kv.get_computed_blocks(b) == ([], 0)
    assert a.block_hashes == b.block_hashes == []  # with caching off nothing pays for hashing


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(8, BS)
    a = make_req("a", list(range(3, 3 + 2 * BS)))
    kv.allocate_slots(a, 2 * BS)
    assert not kv.pool.reset_prefix_cache()
    kv.free(a)
    assert kv.pool.reset_prefix_cache() and not kv.pool.cached


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["get", "free"]), st.integers(0, 5)), max_size=60),
       st.integers(1, 8))
def test_block_pool_get_free_sequences(ops, n_blocks):
    """Raw BlockPool: get_new_blocks / free_blocks in any order keep ref counts and the free queue exact."""
    pool = BlockPool(n_blocks, enable_caching=True)
    held: list[list[KVBlock]] = []
    k = 0
    for op, n in ops:
        if op == "get":
            if n > pool.num_free_blocks:
                with pytest.raises(ValueError):
                    pool.get_new_blocks(n)
                continue
            got = pool.get_new_blocks(n)
            for b in got:
                k += 1
                pool.cache_block(b, hash_block(None, [k]))
            held.append(got)
        elif held:
            pool.free_blocks(reversed(held.pop(n % len(held))))
        pool.check_invariants()
        assert pool.num_free_blocks + sum(map(len, held)) == n_blocks
    for h in held:
        pool.free_blocks(h)
    pool.check_invariants()
    assert pool.num_free_blocks == n_blocks
