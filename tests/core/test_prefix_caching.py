"""Prefix caching: a hit must give exactly what a miss gives, and must really save work.

Three layers:

* **Engine** (tiny random Llama, fp32, greedy): the same arrival schedule is run with prefix caching
  on and off and must give identical tokens, in a plain, a chunked-prefill (hits that end inside a
  chunked prompt) and a preemption regime (small pool: recompute after preemption, LRU eviction),
  with requests arriving while the owner of their prefix is still running, whole-prompt hits (the
  last token is still computed, into a fresh block) and a multi-turn conversation (hits on
  generated tokens). Also: block accounting of a hit, cache-salt isolation, LRU eviction order, and
  what a hash collision would do.
* **Scheduler + KV oracle** (``sched_oracle.KVOracleRunner``, no model): the runner records which
  (salt, token prefix) every KV slot holds and fails as soon as a request would read a slot that is
  not its own. Regression tests for preemption taking back a chunk in the step it was scheduled,
  and a hypothesis state machine over random arrivals / steps / aborts / clock ticks.
* **Block pool** state machine: raw allocate / cache / hit / free interleavings under pressure.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import asyncengine.core.kv_cache_manager as kvm
from asyncengine.core.block_pool import BlockPool, hash_block
from asyncengine.engine_core.core import EngineCore
from asyncengine.core.request import Request, RequestStatus
from asyncengine.sampling_params import SamplingParams
from sched_oracle import Driver, make_req, new_sched

from model_utils import make_core  # noqa: E402

VOCAB = 512

# ---------------------------------------------------------------------------- engine helpers


pytestmark = pytest.mark.usefixtures("one_torch_thread")




def greedy_req(rid: str, prompt: list[int], max_tokens: int, salt: str | None = None, priority: int = 0) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), max_tokens=max_tokens, cache_salt=salt,
                   priority=priority, sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens))


def drive(core: EngineCore, arrivals: dict[int, list[Request]], max_steps: int = 5000) -> dict[str, list[int]]:
    """Step the core, adding ``arrivals[k]`` before step k; returns each request's tokens."""
    arrivals = dict(arrivals)
    outs: dict[str, list[int]] = {r.request_id: [] for rs in arrivals.values() for r in rs}
    for step in range(max_steps):
        for r in arrivals.pop(step, []):
            core.add_request(r)
        if not arrivals and not core.has_unfinished():
            assert core.kv.num_free_blocks == core.num_blocks, "blocks leaked"
            core.kv.pool.check_invariants()
            return outs
        for o in core.step():
            outs.setdefault(o.req_id, []).extend(o.new_token_ids)
    raise AssertionError("engine did not finish")


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


# ---------------------------------------------------------------------------- hit == miss


def shared_prefix_schedule(seed: int = 0):
    """(step -> requests) factory: a 37-token prefix shared by requests that arrive while its owner
    is still prefilling / decoding, a bare-prefix request (whole-prompt hit), one of exactly 4 blocks
    of 8 (whole-prompt hit on a block boundary), and unrelated requests."""
    rng = random.Random(seed)
    prefix = rand_tokens(rng, 37)
    specs = [  # (arrival step, prompt, max_tokens)
        (0, prefix + rand_tokens(rng, 6), 14),  # the owner
        (0, rand_tokens(rng, 29), 9),
        (1, prefix + rand_tokens(rng, 3), 8),  # owner still prefilling (chunked) or decoding
        (3, list(prefix), 6),  # the whole prompt is cached: its last token is still computed
        (4, prefix[:32], 5),  # whole prompt == 4 full blocks of 8
        (5, prefix + rand_tokens(rng, 11), 10),
        (6, rand_tokens(rng, 45), 7),
        (9, prefix[:20] + rand_tokens(rng, 14), 12),  # a hit that ends inside the prefix
        (12, prefix + rand_tokens(rng, 2), 9),
    ]

    def make():
        sched: dict[int, list[Request]] = {}
        for i, (step, prompt, m) in enumerate(specs):
            sched.setdefault(step, []).append(greedy_req(f"r{i}", prompt, m))
        return sched
    return make


REGIMES = {
    "plain": dict(num_kv_blocks=128, block_size=8),
    "chunked": dict(num_kv_blocks=128, block_size=8, max_num_batched_tokens=16),
    # 28 blocks of 4 = 112 slots for ~9 requests of up to ~60 tokens: preemption and eviction
    "preempt": dict(num_kv_blocks=28, block_size=4, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_hit_gives_the_same_tokens_as_a_miss(tiny, regime):
    make = shared_prefix_schedule()
    results, stats = {}, {}
    for caching in (False, True):
        core = make_core(tiny, enable_prefix_caching=caching, **REGIMES[regime])
        results[caching] = drive(core, make())
        stats[caching] = core.stats()
    assert results[True] == results[False]
    on, off = stats[True], stats[False]
    assert off["prefix_cache_hits"] == 0
    assert on["prefix_cache_hits"] >= 4 * 32, on  # several requests hit >= 4 blocks of 8 (or 8 of 4)
    assert on["num_scheduled_tokens"] < off["num_scheduled_tokens"]
    if regime == "preempt":
        assert on["num_preemptions"] > 0 and off["num_preemptions"] > 0
        assert on["num_kv_evictions"] > 0, on


def test_hits_across_chunk_boundaries_and_preemption_fcfs_priority(tiny):
    """Mixed: chunked prefill *and* a small pool, both policies; priorities force preemptions of
    requests mid-prefill whose chunks were already scheduled (see the scheduler regression tests)."""
    rng = random.Random(5)
    prefix = rand_tokens(rng, 30)
    specs = [(s, prefix[:rng.choice([12, 21, 30])] + rand_tokens(rng, rng.randint(1, 12)), rng.randint(2, 9),
              rng.randint(0, 3)) for s in range(12)]

    def make():
        sched: dict[int, list[Request]] = {}
        for i, (step, prompt, m, prio) in enumerate(specs):
            sched.setdefault(step, []).append(greedy_req(f"m{i}", prompt, m, priority=prio))
        return sched

    for policy in ("fcfs", "priority"):
        got = {}
        for caching in (False, True):
            core = make_core(tiny, enable_prefix_caching=caching, num_kv_blocks=14, block_size=4,
                             max_num_batched_tokens=12, max_num_seqs=3, policy=policy)
            got[caching] = drive(core, make())
            if caching:
                s = core.stats()
                assert s["prefix_cache_hits"] > 0 and s["num_preemptions"] > 0, s
        assert got[True] == got[False], policy


def test_multi_turn_hits_generated_tokens(tiny):
    """Turn 2 resends turn 1's prompt and answer: the answer's computed blocks are hits too."""
    rng = random.Random(3)
    p1 = rand_tokens(rng, 20)
    runs = {}
    for caching in (False, True):
        core = make_core(tiny, enable_prefix_caching=caching, num_kv_blocks=64, block_size=8)
        a1 = drive(core, {0: [greedy_req("t1", p1, 12)]})["t1"]
        p2 = p1 + a1 + [7, 8, 9, 10, 11, 12]
        r2 = greedy_req("t2", p2, 8)
        core.add_request(r2)
        first = core.schedule()
        (nr,) = first.new_requests
        # turn 1 computed positions 0..30 (the last answer token never is): 3 full blocks of 8
        assert nr.num_computed_tokens == (24 if caching else 0)
        assert first.num_scheduled_tokens["t2"] == len(p2) - nr.num_computed_tokens
        core.update(first, core.execute(first))
        while core.has_unfinished():
            core.step()
        assert len(r2.output_token_ids) == 8
        runs[caching] = (a1, list(r2.output_token_ids))
    assert runs[True] == runs[False]


def test_prompt_logprobs_bypass_the_cache(tiny):
    """A request asking for prompt logprobs needs every prompt position's logits: it computes its
    whole prompt even when the prompt is cached, and gets every position's logprobs, the same as
    on a cold engine."""
    rng = random.Random(31)
    prompt = rand_tokens(rng, 27)

    def with_plp(rid):
        return Request(request_id=rid, prompt_token_ids=list(prompt), max_tokens=2,
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))

    def prompt_logprobs(core, r):
        core.add_request(r)
        got = []
        while core.has_unfinished():
            for o in core.step():
                got += o.new_prompt_logprobs or []
        return got

    cold = prompt_logprobs(make_core(tiny, num_kv_blocks=64, block_size=4), with_plp("cold"))
    core = make_core(tiny, num_kv_blocks=64, block_size=4)
    drive(core, {0: [greedy_req("warm", prompt, 2)]})  # the prompt's 6 full blocks are cached now
    r = with_plp("plp")
    got = prompt_logprobs(core, r)
    assert r.num_cached_tokens == 0 and len(got) == len(cold) == len(prompt) - 1
    assert got == cold


# ---------------------------------------------------------------------------- accounting of a hit


def test_hit_on_a_4_block_prefix_allocates_only_the_rest(tiny):
    """B shares a 4-block prefix with A, which is still running: B's table starts with A's 4 blocks
    (ref count 2), only ceil(42 / 8) - 4 = 2 blocks are taken from the free queue, and B computes
    only its own 10 tokens."""
    rng = random.Random(11)
    prefix = rand_tokens(rng, 32)
    core = make_core(tiny, num_kv_blocks=64, block_size=8)
    a = greedy_req("a", prefix + rand_tokens(rng, 5), 3)  # 37 tokens: 5 blocks, decodes up to 40 in place
    core.add_request(a)
    core.step()  # a's whole prompt
    a_blocks = core.kv.block_ids("a")
    assert len(a_blocks) == 5
    b = greedy_req("b", prefix + rand_tokens(rng, 10), 4)
    core.add_request(b)
    free0, hits0 = core.kv.num_free_blocks, core.stats()["prefix_cache_hits"]
    so = core.schedule()
    (nr,) = so.new_requests
    assert nr.num_computed_tokens == 32 and so.num_scheduled_tokens["b"] == 10 and so.num_scheduled_tokens["a"] == 1
    assert nr.block_ids[:4] == a_blocks[:4] and len(nr.block_ids) == 6
    assert not set(nr.block_ids[4:]) & set(a_blocks)
    assert free0 - core.kv.num_free_blocks == 2
    assert [core.kv.pool.blocks[i].ref_cnt for i in nr.block_ids] == [2, 2, 2, 2, 1, 1]
    assert core.stats()["prefix_cache_hits"] - hits0 == 32
    core.update(so, core.execute(so))
    drive(core, {})
    assert b.num_cached_tokens == 32


@pytest.mark.parametrize("extra", [0, 1])
def test_whole_prompt_hit_still_computes_the_last_token(tiny, extra):
    """A prompt entirely in the cache: 32 tokens (4 full blocks) hit 3 blocks and recompute the 4th
    into a *new* block (the cached one stays intact for others); 33 tokens hit 4 blocks and compute
    1. Either way the tokens equal the first run's."""
    rng = random.Random(12)
    prompt = rand_tokens(rng, 32 + extra)
    core = make_core(tiny, num_kv_blocks=64, block_size=8)
    first = drive(core, {0: [greedy_req("a", prompt, 6)]})["a"]
    a_blocks = [b.block_id for b in core.kv.pool.cached.values()]
    b = greedy_req("b", prompt, 6)
    core.add_request(b)
    so = core.schedule()
    (nr,) = so.new_requests
    want_hit = 32 if extra else 24
    assert nr.num_computed_tokens == want_hit and so.num_scheduled_tokens["b"] == len(prompt) - want_hit
    if not extra:
        assert nr.block_ids[3] not in a_blocks  # block 3 is recomputed elsewhere
    core.update(so, core.execute(so))
    while core.has_unfinished():
        core.step()
    assert b.output_token_ids == first
    assert b.num_cached_tokens == want_hit


def test_cache_salt_isolation(tiny):
    """Same prompt: different salts never hit each other (nor the unsalted entry); the same salt does."""
    rng = random.Random(13)
    prompt = rand_tokens(rng, 40)
    core = make_core(tiny, num_kv_blocks=64, block_size=8)
    got = {}
    for rid, salt in (("none", None), ("a1", "tenant-a"), ("b1", "tenant-b"), ("a2", "tenant-a"), ("none2", None)):
        r = greedy_req(rid, prompt, 5, salt=salt)
        got[rid] = drive(core, {0: [r]})[rid]
        got[rid + ".cached"] = r.num_cached_tokens
    assert got["none.cached"] == 0 and got["a1.cached"] == 0 and got["b1.cached"] == 0
    assert got["a2.cached"] == 32 and got["none2.cached"] == 32
    assert got["none"] == got["a1"] == got["b1"] == got["a2"] == got["none2"]
    assert core.stats()["prefix_cache_hits"] == 64


def test_lru_eviction_keeps_results_right(tiny):
    """16 blocks of 4. X, Y, Z (6-block family prefix + 2 own tokens, 3 outputs: 8 blocks each) run
    one after another: Z can only get room by evicting, and it evicts X's blocks (least recently
    freed, deepest first) while Y stays cached. Then a new Y request hits its whole family prefix, a
    new X request at most X's first blocks; all tokens equal the no-cache run's."""
    rng = random.Random(14)
    fam = {k: rand_tokens(rng, 24) for k in "XYZ"}
    tails = {k: rand_tokens(rng, 2) for k in ("X", "Y", "Z", "Y2", "X2")}
    order = ["X", "Y", "Z", "Y2", "X2"]
    runs, cached = {}, {}
    for caching in (False, True):
        core = make_core(tiny, num_kv_blocks=16, block_size=4, enable_prefix_caching=caching)
        outs = {}
        for name in order:
            r = greedy_req(name, fam[name[0]] + tails[name], 3)
            outs[name] = drive(core, {0: [r]})[name]
            cached[(caching, name)] = r.num_cached_tokens
        runs[caching] = outs
        if caching:
            assert core.stats()["num_kv_evictions"] > 0
    assert runs[True] == runs[False]
    assert cached[(True, "Z")] == 0 and cached[(True, "Y2")] == 24
    # X was evicted first, deepest blocks first (a request frees its table tail-first), so at most
    # its first blocks survived
    assert cached[(True, "X2")] < 24


# ---------------------------------------------------------------------------- hash collisions


@pytest.mark.parametrize("kind", ["constant", "depth-only"])
def test_hash_collision_serves_the_wrong_kv(tiny, monkeypatch, kind):
    """Documents the design's trust in the hash: a hit is decided by the 128-bit block hash alone,
    stored token ids are never compared. With a hash that collides (``constant``: every block of
    every prompt; ``depth-only``: ignores the token ids), an unrelated prompt "hits" another's
    blocks and silently gets its KV, so its tokens differ from a miss. The bookkeeping stays sound
    (a constant hash even puts the same block several times in one table; ref counts follow). With
    the real sha256 this needs a 2**-64-odds birthday collision (see hash_block)."""
    rng = random.Random(15)
    p1, p2 = rand_tokens(rng, 33), rand_tokens(rng, 33)
    clean = drive(make_core(tiny, num_kv_blocks=64, block_size=8, enable_prefix_caching=False),
                  {0: [greedy_req("p1", p1, 8)], 5: [greedy_req("p2", p2, 8)]})
    if kind == "constant":
        monkeypatch.setattr(kvm, "hash_block", lambda parent, toks, extra=None: b"\x00" * 16)
    else:
        monkeypatch.setattr(kvm, "hash_block", lambda parent, toks, extra=None: hash_block(parent, [], extra))
    core = make_core(tiny, num_kv_blocks=64, block_size=8)
    r2 = greedy_req("p2", p2, 8)
    got = drive(core, {0: [greedy_req("p1", p1, 8)], 5: [r2]})
    assert got["p1"] == clean["p1"]
    assert r2.num_cached_tokens == 32  # four "hits" on p1's blocks
    if kind == "constant":
        assert len(core.kv.pool.cached) == 1  # every block collided with the first one
        hit, _ = core.kv.get_computed_blocks(greedy_req("probe", p2, 1))
        assert len(hit) == 4 and len({b.block_id for b in hit}) == 1  # one block, 4 times in a table
    assert got["p2"] != clean["p2"]


def test_block_hash_is_full_chained_sha256():
    h1 = hash_block(None, [5, 6, 7, 8])
    assert len(h1) == 32
    assert hash_block(h1, [1, 2]) != hash_block(hash_block(None, [5, 6, 7, 9]), [1, 2])
    assert hash_block(None, [1, 2], "s") != hash_block(None, [1, 2]) != hash_block(None, [1, 2], "t")


# ---------------------------------------------------------------------------- scheduler + KV oracle


@pytest.mark.parametrize("overlap", [False, True])
def test_preempted_mid_chunk_leaves_no_unwritten_block_cached(overlap):
    """Regression: a low-priority request whose prefill chunk was scheduled, then taken back out of
    the same step by a higher-priority arrival (``_preempt_lower``), must not leave the blocks that
    chunk would have filled in the prefix cache: their KV was never written. Before the fix, its
    own re-admission (and any request sharing its prompt) hit those blocks and read garbage."""
    s = new_sched(max_num_seqs=1, budget=12)
    d = Driver(s, overlap)
    low = make_req("low", list(range(10, 27)), 3, priority=5)  # 17 tokens: chunks of 12 + 5
    d.add(low)
    d.step()  # low computes 12 tokens (blocks 0-2)
    high = make_req("high", list(range(100, 104)), 3, priority=0)
    d.add(high)
    so = d.step()  # low's 5-token chunk (filling block 3) is scheduled, then preempted for `high`
    assert "high" in so.num_scheduled_tokens and "low" not in so.num_scheduled_tokens
    assert low.num_preemptions == 1
    # what the cache offers for low's prompt now: only what was really computed (3 blocks)
    probe = make_req("probe", low.prompt_token_ids + [50], 1)
    assert s.kv.get_computed_blocks(probe)[1] == 12
    twin = make_req("twin", low.prompt_token_ids + [50, 51], 2, priority=5)
    d.add(twin)
    d.run()
    d.check_done([low, high, twin])


@pytest.mark.parametrize("overlap", [False, True])
def test_victim_whose_fresh_blocks_were_hit_in_the_same_step_is_not_preempted(overlap):
    """A request admitted in this step may hit blocks that a running request's chunk fills in this
    same step (the batch writes K/V before anyone reads). Preempting that running request later in
    the step would leave the hitter reading KV nobody writes: the scheduler must not."""
    s = new_sched(num_blocks=8, max_num_seqs=3, budget=16)
    d = Driver(s, overlap)
    v = make_req("v", list(range(10, 34)), 2, priority=5)  # 24 tokens: chunks of 16 + 8
    d.add(v)
    d.step()
    b = make_req("b", v.prompt_token_ids + [60, 61], 2, priority=0)  # hits all 6 of v's blocks
    c = make_req("c", list(range(100, 120)), 2, priority=1)  # needs 2 blocks: only 1 left
    d.add(b)
    d.add(c)
    so = d.step()
    assert {"v", "b"} <= set(so.num_scheduled_tokens) and "c" not in so.num_scheduled_tokens
    assert v.num_preemptions == 0 and b.num_cached_tokens == 24
    d.run()
    d.check_done([v, b, c])
    assert v.num_preemptions == 1  # c did preempt it, a step later


def test_running_victim_scheduled_earlier_in_the_step():
    """Phase 1 (running requests) under the priority policy: the victim for a running request that
    cannot grow may sit *before* it in the running list, already scheduled in this step (here the
    newer of two equal-priority requests, admitted first because it reached the engine first); the
    block its decode registered in this step must leave the cache too. (Before the fix this stayed
    latent: the allocation that forced the preemption always re-took, and so evicted, the victim's
    deepest block, and a victim scheduled before a running request can only have one fresh block.)"""
    s = new_sched(num_blocks=6, block_size=4, max_num_seqs=3, budget=7, clock=lambda: 10.0)
    d = Driver(s, overlap=False)
    older = make_req("older", list(range(40, 48)), 3, priority=3, arrival_time=0.0)
    newer = make_req("newer", list(range(10, 21)), 7, priority=3, arrival_time=1.0)
    fresh_victims = []
    orig = s.kv.uncache_unscheduled

    def spy(req):
        first = req.num_computed_tokens // 4
        table = s.kv.req_to_blocks[req.request_id][first:s.kv._num_cached_blocks.get(req.request_id, 0)]
        if any(b.block_hash is not None for b in table):
            fresh_victims.append(req.request_id)
        return orig(req)
    s.kv.uncache_unscheduled = spy
    d.add(newer)
    for _ in range(4):
        d.step()
    d.add(older)
    d.run()
    d.check_done([older, newer])
    assert fresh_victims == ["newer"] and newer.num_preemptions >= 1


def test_mid_chunk_preemption_engine_tokens(tiny):
    """The first regression test through the real engine: with prefix caching on, a low-priority
    request preempted in the step its last prompt chunk was scheduled still produces the tokens
    it produces with caching off."""
    rng = random.Random(21)
    low_p, high_p = rand_tokens(rng, 17), rand_tokens(rng, 4)
    got = {}
    for caching in (False, True):
        core = make_core(tiny, enable_prefix_caching=caching, num_kv_blocks=32, block_size=4,
                         max_num_batched_tokens=12, max_num_seqs=1, policy="priority")
        low = greedy_req("low", low_p, 6, priority=5)
        got[caching] = drive(core, {0: [low], 1: [greedy_req("high", high_p, 4, priority=0)]})
        assert low.num_preemptions == 1
    assert got[True] == got[False]


@pytest.mark.parametrize("overlap", [False, True])
def test_aborting_sample_0_releases_the_held_samples(overlap):
    """n = 3 with prefix caching: samples 1 and 2 are held until sample 0 has had its whole prompt.
    Aborting sample 0 alone mid-prompt releases them at the next step; they hit the blocks it did
    write (the oracle checks their contents) and finish with the full greedy output."""
    s = new_sched(num_blocks=16, budget=4, max_num_seqs=3)
    d = Driver(s, overlap)
    r = make_req("r", list(range(10, 22)), 4, n=3)  # 12-token prompt in chunks of 4: 3 steps for sample 0
    d.add(r)
    d.step()
    assert [c.request_id for c in s.samples.held] == ["r#1", "r#2"] and s.num_waiting == 2
    d.step()
    assert d.abort(["r#0"]) == ["r#0"] and "r" in s.samples.parents
    so = d.step()
    (first,) = so.num_scheduled_tokens  # the budget of 4 goes to one of them
    assert not s.samples.held and first in ("r#1", "r#2")
    assert s.requests[first].num_cached_tokens == 8  # the two blocks sample 0 wrote
    d.run()
    d.check_done([r])
    assert d.finish == {"r#0": "abort", "r#1": "length", "r#2": "length"}


@pytest.mark.parametrize("plen, held", [(4, False), (5, True)])
def test_samples_are_held_only_when_a_full_prompt_block_can_be_shared(plen, held):
    """A prompt with no full block before its last token has nothing to share: its samples start
    together in the first step. One more token and samples 1..n-1 wait for sample 0's prompt."""
    s = new_sched(num_blocks=16, block_size=4, budget=32, max_num_seqs=4)
    d = Driver(s)
    r = make_req("r", list(range(10, 10 + plen)), 3, n=3)
    d.add(r)
    so = d.step()
    assert set(so.num_scheduled_tokens) == ({"r#0"} if held else {"r#0", "r#1", "r#2"})
    d.run()
    d.check_done([r])


def test_released_samples_go_before_later_arrivals():
    """FCFS: samples released from the hold arrived with sample 0, so they queue ahead of a request
    that arrived while sample 0 was prefilling (here they take the last seat, it waits)."""
    s = new_sched(num_blocks=16, block_size=4, budget=32, max_num_seqs=2, policy="fcfs")
    d = Driver(s)
    r = make_req("r", list(range(10, 18)), 3, n=2)
    d.add(r)
    d.step()  # sample 0's whole prompt
    late = make_req("late", [50, 51, 52], 2)
    d.add(late)
    so = d.step()
    assert [nr.req_id for nr in so.new_requests] == ["r#1"] and late.status == RequestStatus.WAITING
    d.run()
    d.check_done([r, late])


# the hypothesis machine: random arrivals (shared prefixes, salts, priorities, n > 1), steps, aborts
# (of whole requests or of single samples) and clock ticks (priority aging) against the KV oracle
PREFIXES = [list(range(10, 30)), list(range(10, 22)) + [90, 91, 92, 93], [40, 41, 42, 43, 44, 45, 46], []]
SEEN = {"hits": 0, "preemptions": 0, "evictions": 0, "uncache_refusals": 0, "uncached_blocks": 0,
        "held": 0, "sample_aborts": 0, "sample_preemptions": 0}


class SchedulerKVMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 12), block_size=st.sampled_from([2, 4]), budget=st.integers(2, 16),
                max_num_seqs=st.integers(1, 3), policy=st.sampled_from(["fcfs", "priority", "priority"]),
                caching=st.sampled_from([True, True, True, False]), overlap=st.booleans())
    def setup(self, num_blocks, block_size, budget, max_num_seqs, policy, caching, overlap):
        self.now = 0.0
        self.sched = new_sched(num_blocks, block_size, max_num_seqs, budget, policy, caching,
                               clock=lambda: self.now)
        if policy == "priority":
            self.sched.waiting.aging_s = 4.0
        self.d = Driver(self.sched, overlap)
        self.cap = num_blocks * block_size
        self.reqs: list[Request] = []
        self.ids: list[str] = []  # what an abort may name: user ids and single samples' ids
        orig = self.sched.kv.uncache_unscheduled

        def counted(req):
            before = len(self.sched.kv.pool.cached)
            ok = orig(req)
            SEEN["uncache_refusals"] += not ok
            SEEN["uncached_blocks"] += before - len(self.sched.kv.pool.cached)
            return ok
        self.sched.kv.uncache_unscheduled = counted

    @precondition(lambda self: len(self.ids) < 18)
    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 20), tail=st.lists(st.integers(3, 5), max_size=6),
          max_tokens=st.integers(1, 10), priority=st.integers(0, 3), salt=st.sampled_from([None, None, "s"]),
          n=st.sampled_from([1, 1, 2, 3]))
    def add(self, prefix, cut, tail, max_tokens, priority, salt, n):
        prompt = (prefix[:cut] + tail)[: self.cap - 1] or [7]
        max_tokens = max(1, min(max_tokens, self.cap - len(prompt)))
        r = make_req(f"r{len(self.reqs)}", prompt, max_tokens, priority=priority, salt=salt,
                     arrival_time=self.now, n=n)
        self.reqs.append(r)
        samples = self.d.add(r)
        self.ids.append(r.request_id)
        if n > 1:
            self.ids += [c.request_id for c in samples]
            SEEN["held"] += len(self.sched.samples.held)

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            self.d.step()

    @rule(dt=st.sampled_from([0.5, 2.0, 5.0]))
    def tick(self, dt):
        self.now += dt

    @precondition(lambda self: self.ids)
    @rule(i=st.integers(0, 30))
    def abort(self, i):
        done = self.d.abort([self.ids[i % len(self.ids)]])
        SEEN["sample_aborts"] += len(done) == 1 and "#" in done[0]

    @invariant()
    def consistent(self):
        if hasattr(self, "sched"):
            self.sched.kv.pool.check_invariants()

    def teardown(self):
        if not hasattr(self, "d"):
            return
        self.d.run()
        self.d.check_done(self.reqs)
        pool = self.sched.kv.pool
        SEEN["hits"] += self.sched.kv.prefix_hits
        SEEN["preemptions"] += self.sched.stats.num_preemptions
        SEEN["evictions"] += pool.num_evictions
        SEEN["sample_preemptions"] += sum(r.num_preemptions for r in self.d.seen if r.parent_id is not None)


def test_scheduler_kv_state_machine():
    for k in SEEN:
        SEEN[k] = 0
    run_state_machine_as_test(SchedulerKVMachine, settings=settings(
        max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)))
    print(SEEN)
    assert all(SEEN[k] > 0 for k in ("hits", "preemptions", "evictions", "held", "sample_aborts",
                                     "sample_preemptions")), SEEN


# ---------------------------------------------------------------------------- raw block pool machine


class BlockPoolMachine(RuleBasedStateMachine):
    """Owners take new blocks, register them under content hashes, take cached blocks by hash (a
    prefix hit, possibly reviving a free one) and drop them, in any order, on a small pool: no block
    is ever lost or handed out twice while referenced, and the free queue / hash map stay exact."""

    @initialize(n=st.integers(1, 10))
    def setup(self, n):
        self.pool = BlockPool(n)
        self.owners: list[list] = []
        self.content: dict[int, bytes] = {}  # block id -> hash of what was written there

    @rule(k=st.integers(1, 4))
    def allocate(self, k):
        if k > self.pool.num_free_blocks:
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(k)
            return
        blocks = self.pool.get_new_blocks(k)
        held = {b.block_id for o in self.owners for b in o}
        assert not held & {b.block_id for b in blocks}, "a referenced block handed out again"
        for b in blocks:
            assert b.ref_cnt == 1 and b.block_hash is None
            self.content.pop(b.block_id, None)
        self.owners.append(blocks)

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 50), j=st.integers(0, 3), key=st.integers(0, 5))
    def register(self, i, j, key):
        o = self.owners[i % len(self.owners)]
        b = o[j % len(o)]
        h = bytes([key]) * 16
        if b.block_id in self.content:  # already written with some content: keep it
            h = self.content[b.block_id]
        self.content[b.block_id] = h
        self.pool.cache_block(b, h)

    @rule(key=st.integers(0, 5))
    def hit(self, key):
        b = self.pool.get_cached_block(bytes([key]) * 16)
        if b is None:
            return
        assert self.content.get(b.block_id) == b.block_hash, "a cached block serves other content"
        self.pool.touch([b])
        self.owners.append([b])

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 50))
    def release(self, i):
        self.pool.free_blocks(reversed(self.owners.pop(i % len(self.owners))))

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        p = self.pool
        p.check_invariants()
        refs: dict[int, int] = {}
        for o in self.owners:
            for b in o:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        assert all(b.ref_cnt == refs.get(b.block_id, 0) for b in p.blocks)
        assert p.num_free_blocks + len(refs) == p.num_blocks

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        while self.owners:
            self.pool.free_blocks(self.owners.pop())
        self.pool.check_invariants()
        assert self.pool.num_free_blocks == self.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)


def test_block_pool_state_machine():
    run_state_machine_as_test(BlockPoolMachine, settings=settings(
        max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)))
