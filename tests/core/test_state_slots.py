"""The state-slot cache group of hybrid models, scheduler side: the slot pool, the hybrid KV-cache
manager that takes a request's blocks and slot together (or neither), and the one memory budget
they share (core/kv_sizing.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine import EngineConfig, SamplingParams
from asyncengine.core.hybrid_kv_cache_manager import HybridKVCacheManager
from asyncengine.contracts.kv_sizing import plan_kv_blocks
from asyncengine.core.request import Request
from asyncengine.core.state_slots import StateSlotPool
from asyncengine.errors import ConfigError


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=60), size=st.integers(1, 5))
def test_slot_pool_never_gives_one_slot_twice(ops, size):
    pool = StateSlotPool(size)
    held: dict[str, int] = {}
    for take, who in ops:
        rid = f"r{who}"
        if take:
            slot = pool.allocate(rid)
            if rid in held:
                assert slot == held[rid]  # asking again gives the same slot
            elif len(held) == size:
                assert slot is None
            else:
                assert slot is not None and 0 <= slot < size
                held[rid] = slot
        else:
            pool.free(rid)
            held.pop(rid, None)
        assert len(set(held.values())) == len(held)
        assert pool.num_free == size - len(held)
        assert all(pool.slot_of(r) == s for r, s in held.items())


def req(rid: str, n: int = 10) -> Request:
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=4), eos_token_ids=set(), max_tokens=4)


def test_blocks_and_slot_are_taken_together_or_not_at_all():
    kv = HybridKVCacheManager(num_blocks=8, block_size=4, num_state_slots=2, state_bytes_per_slot=100)
    a, b, c = req("a"), req("b"), req("c")
    assert kv.allocate_slots(a, 10) is not None and kv.state_slot("a") >= 0
    assert kv.allocate_slots(b, 10) is not None
    assert kv.slots.num_free == 0
    free_blocks = kv.num_free_blocks
    assert kv.allocate_slots(c, 1) is None  # no slot: no block taken either
    assert kv.num_free_blocks == free_blocks and kv.state_slot("c") == -1
    assert kv.allocate_slots(a, 2) is not None  # a running request keeps its slot as it grows
    kv.free(b)
    assert kv.slots.num_free == 1
    big = req("big", 40)
    assert kv.allocate_slots(big, 40) is None  # blocks run out: no slot taken
    assert kv.slots.num_free == 1 and kv.state_slot("big") == -1
    kv.free(a)
    kv.free(c)  # never allocated: a no-op
    assert kv.slots.num_free == 2 and kv.num_free_blocks == 8
    assert not kv.enable_caching
    assert kv.group_stats()["state_cache_bytes"] == 200


def cfg(**kw) -> tuple:
    """What the sizing reads of an engine config: its cache view and max_num_seqs."""
    config = EngineConfig(dtype="float32", device="cpu", **kw)
    return config.cache_config, config.scheduler_config.max_num_seqs


def test_states_come_out_of_the_same_budget():
    per_block, states = 1000, 4 * 5000
    plain = plan_kv_blocks(*cfg(max_num_seqs=4, kv_cache_bytes=100_000), per_block, 1024, None)
    hybrid = plan_kv_blocks(*cfg(max_num_seqs=4, kv_cache_bytes=100_000), per_block, 1024, None, state_bytes=states)
    assert plain.num_blocks == 100 and hybrid.num_blocks == 80
    capped = plan_kv_blocks(*cfg(max_num_seqs=64, kv_cache_memory_fraction=0.5), per_block, 4096, 400_000,
                            state_bytes=states)
    assert capped.num_blocks == (200_000 - states) // per_block


def test_no_attention_layers_blocks_only_count_tokens():
    plan = plan_kv_blocks(*cfg(max_num_seqs=2), 0, 1024, 1 << 30, state_bytes=2 * 5000)
    assert plan.num_blocks == 2 * (1024 // 16) + 1 and plan.nbytes == 0
    assert plan_kv_blocks(*cfg(max_num_seqs=2, num_kv_blocks=24), 0, 1024, None).num_blocks == 24


def test_states_larger_than_the_budget_are_refused():
    with pytest.raises(ConfigError, match="state slots of max_num_seqs=256"):
        plan_kv_blocks(*cfg(max_num_seqs=256, kv_cache_bytes=1 << 20), 1000, 1024, None, state_bytes=256 * 8192)
