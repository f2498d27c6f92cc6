"""The sliding-window KV-cache manager: out-of-window blocks go back to the pool while a request
runs, prefix hits need only the window's blocks, and the pool's books always balance.

Two layers: the manager driven directly (a hypothesis state machine over arrivals, prefill chunks,
decodes, preemptions and finishes with a shared-prefix prompt set) and the engine (a tiny
Mistral whose every layer slides over 16 tokens, fp32 greedy against transformers, the pool's own
count of blocks held checked at the end of a long request, prefix hits, preemption).
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from asyncengine.contracts.kv_cache_spec import kv_cache_groups
from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.request import Request
from asyncengine.core.grouped_kv_cache_manager import GroupedKVCacheManager
from asyncengine.core.sliding_window_kv_cache_manager import NULL_BLOCK, SlidingWindowKVCacheManager
from asyncengine.errors import ConfigError
from asyncengine.sampling_params import SamplingParams
from test_grouped_kv_cache_manager import manager_for  # the views an engine core hands the factory

BS, WINDOW, NUM_BLOCKS = 4, 10, 40
CAP = -(-WINDOW // BS) + 2  # blocks a decoding request may hold: ceil(w / bs) + 2 (w / bs + 2 when bs | w)


def req(rid: str, prompt: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), max_tokens=1000,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=1000))


def step(kv, r: Request, n: int, hit=None) -> bool:
    """Schedule ``n`` tokens of ``r`` (after a hit), as the scheduler does; False: no room."""
    if hit is not None:
        blocks, num_hit = hit
        if kv.allocate_slots(r, n, blocks) is None:
            return False
        r.num_computed_tokens = num_hit
    elif kv.allocate_slots(r, n) is None:
        return False
    r.num_computed_tokens += n
    while r.num_computed_tokens >= r.num_tokens:  # a decode step samples one token
        r.output_token_ids.append(7 + len(r.output_token_ids) % 5)
    return True


def test_kv_cache_groups_by_window():
    groups = kv_cache_groups([None, 16, None, 8, 16])
    assert [(g.sliding_window, g.layers) for g in groups] == [(None, (0, 2)), (8, (3,)), (16, (1, 4))]
    assert kv_cache_groups([]) == []


def test_decode_frees_blocks_that_left_the_window():
    kv = SlidingWindowKVCacheManager(NUM_BLOCKS, BS, WINDOW)
    r = req("a", list(range(3, 23)))  # 20 prompt tokens
    assert step(kv, r, 20)
    for _ in range(60):
        assert step(kv, r, 1)
        assert kv.held_blocks("a") <= CAP
        assert kv.num_free_blocks + kv.held_blocks("a") == NUM_BLOCKS
    table = kv.req_to_blocks["a"]
    assert len(table) == -(-r.num_computed_tokens // BS)  # one entry per logical block, positions kept
    first = kv.first_kept_block(r.num_computed_tokens)
    assert all(b is NULL_BLOCK for b in table[:first]) and NULL_BLOCK not in table[first:]
    kv.free(r)
    assert kv.num_free_blocks == NUM_BLOCKS and not kv.req_to_blocks
    kv.pool.check_invariants()


def test_prefix_hit_needs_only_the_window_blocks():
    kv = SlidingWindowKVCacheManager(NUM_BLOCKS, BS, WINDOW)
    prompt = list(range(3, 43))  # 40 tokens = 10 blocks
    a = req("a", prompt)
    assert step(kv, a, 40)
    assert step(kv, a, 1)  # the next step frees what its first query no longer sees
    assert kv.held_blocks("a") < 10  # its first blocks left the window and went back to the pool
    kv.free(a)
    b = req("b", prompt)
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 36  # 9 whole blocks: the last token is always computed
    first = kv.first_kept_block(num_hit)
    assert blocks[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in blocks[first:]
    assert step(kv, b, 40 - num_hit, (blocks, num_hit))
    assert kv.held_blocks("b") <= CAP + 1
    # evicting a block inside the window shortens the hit to where a whole window is cached
    kv.free(b)
    c = req("c", prompt)
    window_block = kv.get_computed_blocks(c)[0][-1]
    kv.pool.uncache_block(window_block)
    _, shorter = kv.get_computed_blocks(c)
    assert shorter == 32
    kv.pool.check_invariants()


def test_mixed_and_refused_configs(caplog):
    from asyncengine.config import EngineConfig

    cfg = EngineConfig(model="unused", block_size=BS, enable_prefix_caching=True)
    with caplog.at_level("INFO"):
        assert type(manager_for(cfg, (None, 16), NUM_BLOCKS)) is GroupedKVCacheManager  # a table per group
    assert "2 block tables" in caplog.text
    assert type(manager_for(cfg, (None, None), NUM_BLOCKS)) is KVCacheManager
    assert manager_for(cfg, (16, 16), NUM_BLOCKS).sliding_window == 16
    with pytest.raises(ConfigError, match="KV offload"):
        manager_for(EngineConfig(model="unused", block_size=BS, kv_offload_bytes=2**20), (16, 16), NUM_BLOCKS)


PROMPTS = [list(range(3, 3 + n)) for n in (6, 13, 21)] + [list(range(3, 15)) + [99] * 9]


class SlidingMachine(RuleBasedStateMachine):
    """Random arrivals (prompts sharing prefixes), chunks, decodes, preemptions and finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = SlidingWindowKVCacheManager(NUM_BLOCKS, BS, WINDOW)
        self.running: dict[str, Request] = {}
        self.decoding: set[str] = set()
        self.n = 0

    @rule(p=st.sampled_from(range(len(PROMPTS))), chunk=st.integers(1, 16))
    def arrive(self, p, chunk):
        self.n += 1
        r = req(f"r{self.n}", PROMPTS[p])
        hit = self.kv.get_computed_blocks(r)
        n = min(chunk, r.num_tokens - hit[1])
        if step(self.kv, r, n, hit):
            self.running[r.request_id] = r

    @rule(data=st.data(), chunk=st.integers(1, 16))
    def advance(self, data, chunk):
        if not self.running:
            return
        r = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        n = max(1, min(chunk, r.num_tokens - r.num_computed_tokens))
        if step(self.kv, r, n):
            if r.num_computed_tokens >= r.num_prompt_tokens:
                self.decoding.add(r.request_id)
        elif r.request_id in self.decoding:  # no room for a decode: preempt it, as the scheduler would
            self.finish(r)

    @rule(data=st.data())
    def finish_one(self, data):
        if self.running:
            self.finish(self.running[data.draw(st.sampled_from(sorted(self.running)))])

    def finish(self, r: Request) -> None:
        self.kv.free(r)
        del self.running[r.request_id]
        self.decoding.discard(r.request_id)

    @invariant()
    def books_balance(self):
        kv = self.kv
        kv.pool.check_invariants()
        held = {b.block_id for blocks in kv.req_to_blocks.values() for b in blocks if b is not NULL_BLOCK}
        assert kv.num_free_blocks + len(held) == NUM_BLOCKS  # free + used == total: nothing leaked
        assert set(kv.req_to_blocks) == set(self.running)
        for rid in self.decoding:  # a decoding request holds no more than its window needs
            assert kv.held_blocks(rid) <= CAP

    def teardown(self):
        for r in list(self.running.values()):
            self.finish(r)
        assert self.kv.num_free_blocks == NUM_BLOCKS


def test_manager_invariants_hold_under_random_schedules():
    run_state_machine_as_test(SlidingMachine, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)))


# ---------------------------------------------------------------------------- the engine


ENGINE_WINDOW, ENGINE_BS, ENGINE_BLOCKS = 16, 4, 24  # 24 blocks = 96 slots for a 4,000-token request


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


@pytest.mark.usefixtures("one_torch_thread")
def test_long_request_holds_its_window_only_and_matches_transformers(tiny_model_dir, hf_reference):
    """4,000 tokens through a 96-slot cache: only freeing out-of-window blocks makes it fit."""
    from asyncengine import LLM, SamplingParams as SP
    from model_utils import compare, model_hook

    d = tiny_model_dir("mistral", sliding_window=ENGINE_WINDOW, max_position_embeddings=4096)
    long = (tokens(1, 4000), 8)
    llm = LLM(d, dtype="float32", block_size=ENGINE_BS, num_kv_blocks=ENGINE_BLOCKS, max_num_batched_tokens=64)
    kv = llm.engine.kv
    assert isinstance(kv, SlidingWindowKVCacheManager) and llm.engine.max_model_len >= 4008
    held: list[int] = []
    with model_hook(llm, lambda k: held.append(ENGINE_BLOCKS - kv.num_free_blocks)):
        out = llm.generate([long[0]], SP(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert held[-1] <= ENGINE_WINDOW // ENGINE_BS + 2  # the pool's own count at the request's last step
    refs = hf_reference(d, [long])
    counts = compare([out[0].outputs[0].token_ids], refs)  # raises at a real mismatch
    assert counts["exact"] + counts["near_tie"] == 1
    assert kv.num_free_blocks == ENGINE_BLOCKS and not kv.req_to_blocks
    kv.pool.check_invariants()


@pytest.mark.usefixtures("one_torch_thread")
def test_prefix_hits_and_preemption_give_the_same_tokens(tiny_model_dir, hf_reference):
    from asyncengine import LLM, SamplingParams as SP
    from model_utils import compare

    d = tiny_model_dir("mistral", sliding_window=ENGINE_WINDOW, max_position_embeddings=4096)
    shared = tokens(2, 120)
    requests = [(shared + tokens(10 + i, 9 * i), 40) for i in range(4)]
    refs = hf_reference(d, requests)
    # 16 blocks: three decoding requests need 3 x 6, so one is preempted (and recomputed, hitting the cache)
    llm = LLM(d, dtype="float32", block_size=ENGINE_BS, num_kv_blocks=16, max_num_batched_tokens=32)
    params = SP(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = llm.generate([requests[0][0]], params, use_tqdm=False)  # caches the shared prefix
    rest = llm.generate([p for p, _ in requests[1:]], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in first + rest]
    counts = compare(got, refs)
    assert counts["exact"] + counts["near_tie"] == len(requests)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0
    kv = llm.engine.kv
    assert kv.num_free_blocks == 16 and not kv.req_to_blocks
    kv.pool.check_invariants()


def test_speculative_decoding_is_refused_with_the_reason(tiny_model_dir):
    from asyncengine import LLM

    d = tiny_model_dir("mistral", sliding_window=ENGINE_WINDOW, max_position_embeddings=4096)
    with pytest.raises(ConfigError, match="speculative decoding is not supported with sliding-window KV blocks"):
        LLM(d, dtype="float32", block_size=ENGINE_BS, num_kv_blocks=ENGINE_BLOCKS,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.usefixtures("one_torch_thread")
def test_batch_invariant_mode_keeps_a_row_alone_and_batched_equal(tiny_model_dir):
    """Freed slots (read under the mask) must not leak another request's bits into a row."""
    from asyncengine import LLM, SamplingParams as SP

    d = tiny_model_dir("mistral", sliding_window=ENGINE_WINDOW, max_position_embeddings=4096)
    llm = LLM(d, dtype="float32", block_size=ENGINE_BS, num_kv_blocks=ENGINE_BLOCKS, max_num_batched_tokens=32,
              batch_invariant=True, enable_prefix_caching=False)
    params = SP(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1)
    prompts = [tokens(20 + i, 40 + 7 * i) for i in range(3)]
    alone = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0]
    batched = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    assert isinstance(llm.engine.kv, SlidingWindowKVCacheManager)
    assert batched.token_ids == alone.token_ids and batched.logprobs == alone.logprobs
