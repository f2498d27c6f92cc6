"""The per-group KV-cache manager of models mixing full and sliding-window layers: one table per
group from one pool, sliding groups freeing what left their window, prefix hits every group can
serve, and the pool's books always balancing.

The engine side (tiny Gemma 2 / Gemma 3 / Qwen2 against transformers) is in
tests/models/test_kv_cache_groups.py.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from asyncengine.contracts.kv_cache_spec import block_table_groups
from asyncengine.core.grouped_kv_cache_manager import GroupedKVCacheManager, make_kv_cache_manager
from asyncengine.core.kv_cache_manager import NULL_BLOCK
from asyncengine.errors import ConfigError
from asyncengine.core.request import Request
from asyncengine.sampling_params import SamplingParams

BS, WINDOW, NUM_BLOCKS = 4, 10, 60
WINDOWS = [None, WINDOW, WINDOW]  # a Gemma-3-like shape: one full group, two sliding ones
CAP = -(-WINDOW // BS) + 2  # blocks a decoding request may hold in a sliding group


PROMPTS = [list(range(3, 3 + n)) for n in (6, 13, 21)] + [list(range(3, 15)) + [99] * 9]


def req(rid: str, prompt: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), max_tokens=1000,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=1000))


def step(kv, r: Request, n: int, hit=None) -> bool:
    """Schedule ``n`` tokens of ``r`` (after a hit), as the scheduler does; False: no room."""
    if kv.allocate_slots(r, n, hit[0] if hit else None) is None:
        return False
    if hit is not None:
        r.num_computed_tokens = hit[1]
    r.num_computed_tokens += n
    while r.num_computed_tokens >= r.num_tokens:  # a decode step samples one token
        r.output_token_ids.append(7 + len(r.output_token_ids) % 5)
    return True


def held_ids(kv: GroupedKVCacheManager) -> set[int]:
    return {b.block_id for sub in kv.groups for blocks in sub.req_to_blocks.values()
            for b in blocks if b is not NULL_BLOCK}


def test_block_table_groups_cut_kinds_to_equal_groups():
    gemma3 = [8, 8, 8, 8, 8, None] * 2  # 10 local, 2 global layers
    groups = block_table_groups(gemma3)
    assert [(g.sliding_window, g.layers) for g in groups] == [
        (None, (5, 11)), (8, (0, 1)), (8, (2, 3)), (8, (4, 6)), (8, (7, 8)), (8, (9, 10))]
    assert len(block_table_groups([None] * 4)) == 1 and len(block_table_groups([8] * 3)) == 1
    short = block_table_groups([None, None, 8, 8, 8])  # the last sliding group is short
    assert [g.layers for g in short] == [(0, 1), (2, 3), (4,)]
    assert [g.layers for g in block_table_groups([None, 8])] == [(0,), (1,)]


def test_sliding_groups_free_while_the_full_group_keeps_all():
    kv = GroupedKVCacheManager(NUM_BLOCKS, BS, WINDOWS)
    r = req("a", list(range(3, 23)))  # 20 prompt tokens
    assert step(kv, r, 20)
    assert kv.take_new_group_block_ids("a") and not any(kv.take_new_group_block_ids("a"))  # taken once
    for _ in range(40):
        assert step(kv, r, 1)
        for g in (1, 2):
            assert kv.held_blocks("a", g) <= CAP
        assert kv.held_blocks("a", 0) == -(-r.num_computed_tokens // BS)
        assert kv.num_free_blocks + len(held_ids(kv)) == NUM_BLOCKS
    # every group's table keeps one entry per logical block (positions kept)
    assert {len(sub.req_to_blocks["a"]) for sub in kv.groups} == {-(-r.num_computed_tokens // BS)}
    assert len(set(kv.block_ids("a")) & {i for t in kv.group_block_ids("a") for i in t} - {0}) == 0
    assert kv.group_stats() == {"kv_cache_groups": 3,
                                "kv_sliding_group_blocks": kv.held_blocks("a", 1) + kv.held_blocks("a", 2)}
    kv.free(r)
    assert kv.num_free_blocks == NUM_BLOCKS and not kv.req_to_blocks
    kv.pool.check_invariants()


def test_longest_request_fits_every_group_at_once():
    from asyncengine.config import EngineConfig

    kv = GroupedKVCacheManager(NUM_BLOCKS, BS, WINDOWS)  # 60 blocks
    chunked = EngineConfig(model="unused", block_size=BS, max_num_batched_tokens=8).scheduler_config
    # under chunked prefill a sliding group holds at most (8 + 10) / 4 + 2 = 7 blocks: 60 - 14 for the full one
    assert kv.max_request_len(chunked, 10_000) == (NUM_BLOCKS - 2 * 7) * BS
    whole = EngineConfig(model="unused", block_size=BS, enable_chunked_prefill=False,
                         max_num_batched_tokens=10_000).scheduler_config
    assert kv.max_request_len(whole, 10_000) == NUM_BLOCKS // 3 * BS  # a whole prompt: every group every block
    assert kv.max_request_len(chunked, 50) == 50


def test_the_pool_holds_the_memory_of_whole_model_blocks():
    """Sizing prices whole-model blocks as for any model; the pool gets that memory in one-group blocks."""
    from asyncengine.config import EngineConfig
    from asyncengine.contracts.kv_cache_spec import KVCacheSpec
    from asyncengine.engine_core.core import num_kv_blocks_for

    windows = (8, 8, None, 8, 8, None)  # groups of 2 layers: full (2, 5), sliding (0, 1), (3, 4)
    spec = KVCacheSpec(block_size=BS, bytes_per_block=2 * 1000, available_bytes=None, layer_windows=windows)
    pinned = EngineConfig(model="unused", block_size=BS, num_kv_blocks=10)
    assert num_kv_blocks_for(pinned, spec, 4096) == 30
    by_bytes = EngineConfig(model="unused", block_size=BS, kv_cache_bytes=6000 * 7)
    assert num_kv_blocks_for(by_bytes, spec, 4096) == 21  # 7 whole-model blocks of 6 layers = 21 of 2
    one = EngineConfig(model="unused", block_size=BS, num_kv_blocks=10, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2})
    assert num_kv_blocks_for(one, spec, 4096) == 10  # one table: blocks of every layer


def test_allocation_is_all_groups_or_none():
    kv = GroupedKVCacheManager(7, BS, WINDOWS)
    r = req("a", list(range(3, 15)))  # 12 tokens: 3 blocks per group = 9 > 7
    assert kv.allocate_slots(r, 12) is None
    assert kv.num_free_blocks == 7 and not any(sub.req_to_blocks for sub in kv.groups)
    assert kv.allocate_slots(r, 8) is not None and kv.num_free_blocks == 1


def test_prefix_hit_is_what_every_group_serves():
    kv = GroupedKVCacheManager(NUM_BLOCKS, BS, WINDOWS)
    prompt = list(range(3, 43))  # 40 tokens = 10 blocks
    a = req("a", prompt)
    assert step(kv, a, 40) and step(kv, a, 1)
    kv.free(a)
    b = req("b", prompt)
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 36 and len(hit.groups) == 3
    first = kv.groups[1].first_kept_block(num_hit)
    assert hit.groups[0] == hit and NULL_BLOCK not in hit.groups[0]  # the full group: every block
    for g in (1, 2):  # the sliding groups: the window's blocks, NULL_BLOCK before
        assert hit.groups[g][:first] == [NULL_BLOCK] * first and NULL_BLOCK not in hit.groups[g][first:]
        assert not {b.block_id for b in hit.groups[g][first:]} & {b.block_id for b in hit.groups[0]}
    # a full-group block evicted mid-prompt cuts the hit there; a sliding one inside the window, to
    # where a whole window is cached again
    kv.pool.uncache_block(hit.groups[0][6])
    assert kv.get_computed_blocks(req("c", prompt))[1] == 24
    kv.pool.uncache_block(kv.groups[2].pool.get_cached_block(b.block_hashes[4]))  # before this hit's window
    assert kv.get_computed_blocks(req("d", prompt))[1] == 16
    assert step(kv, b, 40 - num_hit, (hit, num_hit))  # the first hit still allocates (blocks touched)
    assert kv.held_blocks("b", 0) == 10
    kv.free(b)
    assert kv.num_free_blocks == NUM_BLOCKS
    kv.pool.check_invariants()
    # new weights: every group forgets its prefixes, and a new request's hashes chain from the new root
    assert kv.get_computed_blocks(req("e", prompt))[1] > 0
    kv.reset_prefix_cache([])
    assert kv.get_computed_blocks(req("f", prompt))[1] == 0 and not kv.pool.cached
    g = req("g", prompt)
    assert step(kv, g, 40) and kv.get_computed_blocks(req("h", prompt))[1] == 36


def manager_for(cfg, layer_windows, num_blocks: int):
    """The manager an engine core with ``cfg`` makes: its cache view, and the views that decide
    whether a mixed model keeps one table."""
    return make_kv_cache_manager(cfg.cache_config, layer_windows, num_blocks, speculative=cfg.speculative,
                                 kv_transfer=cfg.kv_transfer_config, parallel=cfg.parallel_config)


def test_what_needs_one_table_keeps_one(caplog):
    """Speculative decoding, KV offload, P/D and pipeline parallelism read or move whole tables:
    a mixed model keeps one plain table under them (every block, as before per-group tables)."""
    from asyncengine.config import EngineConfig
    from asyncengine.core.kv_cache_manager import KVCacheManager

    spec = {"method": "ngram", "num_speculative_tokens": 2}
    for options in (dict(kv_offload_bytes=2**20), dict(speculative_config=spec)):
        cfg = EngineConfig(model="unused", block_size=BS, **options)
        with caplog.at_level("INFO"):
            assert type(manager_for(cfg, (None, 8), 40)) is KVCacheManager
    assert "keeps one table with every block under speculative decoding" in caplog.text
    cfg = EngineConfig(model="unused", block_size=BS)
    assert type(manager_for(cfg, (None, 8), 40)) is GroupedKVCacheManager
    with pytest.raises(ConfigError, match="speculative decoding"):  # all sliding: refused as before
        manager_for(EngineConfig(model="unused", block_size=BS, speculative_config=spec), (8, 8), 40)


class GroupedMachine(RuleBasedStateMachine):
    """Random arrivals (prompts sharing prefixes), chunks, decodes, preemptions and finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = GroupedKVCacheManager(NUM_BLOCKS, BS, WINDOWS)
        self.running: dict = {}
        self.decoding: set[str] = set()
        self.n = 0

    @rule(p=st.sampled_from(range(len(PROMPTS))), chunk=st.integers(1, 16))
    def arrive(self, p, chunk):
        self.n += 1
        r = req(f"r{self.n}", PROMPTS[p])
        hit = self.kv.get_computed_blocks(r)
        if step(self.kv, r, min(chunk, r.num_tokens - hit[1]), hit):
            self.running[r.request_id] = r

    @rule(data=st.data(), chunk=st.integers(1, 16))
    def advance(self, data, chunk):
        if not self.running:
            return
        r = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        decode = r.num_computed_tokens >= r.num_prompt_tokens  # (the step ending a prefill holds its chunk)
        if step(self.kv, r, max(1, min(chunk, r.num_tokens - r.num_computed_tokens))):
            if decode:
                self.decoding.add(r.request_id)
        elif r.request_id in self.decoding:  # no room for a decode: preempt it, as the scheduler would
            self.finish(r)

    @rule(data=st.data())
    def finish_one(self, data):
        if self.running:
            self.finish(self.running[data.draw(st.sampled_from(sorted(self.running)))])

    def finish(self, r) -> None:
        self.kv.free(r)
        del self.running[r.request_id]
        self.decoding.discard(r.request_id)

    @invariant()
    def books_balance(self):
        kv = self.kv
        kv.pool.check_invariants()
        held = [b for sub in kv.groups for blocks in sub.req_to_blocks.values() for b in blocks if b is not NULL_BLOCK]
        assert kv.num_free_blocks + len({b.block_id for b in held}) == NUM_BLOCKS  # nothing leaked
        for b in set(held):  # a block is referenced exactly as often as tables name it
            assert b.ref_cnt == sum(1 for x in held if x is b)
        by_group = [{b.block_id for blocks in sub.req_to_blocks.values() for b in blocks if b is not NULL_BLOCK}
                    for sub in kv.groups]
        for g, ids in enumerate(by_group):  # a block serves one group's layers at a time
            assert not ids & set().union(*by_group[:g], *by_group[g + 1:])
        for sub in kv.groups:
            assert set(sub.req_to_blocks) == set(self.running)
        for rid in self.decoding:
            for g in (1, 2):
                assert kv.held_blocks(rid, g) <= CAP

    def teardown(self):
        for r in list(self.running.values()):
            self.finish(r)
        assert self.kv.num_free_blocks == NUM_BLOCKS


def test_manager_invariants_hold_under_random_schedules():
    run_state_machine_as_test(GroupedMachine, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)))
