"""The priority policy: lower ``priority`` runs first, with aging against starvation.

Rule under test (``PriorityQueue``): a request's *effective* priority is
``priority - floor((now - arrival_time) / priority_aging_s)``; the waiting queue serves the lowest
(effective priority, arrival time) first; a waiting request may preempt the running request with
the worst (effective priority, arrival) only if it is *strictly* better; under memory pressure the
same worst running request is the victim.

* a late high-priority request overtakes earlier low-priority ones on a full cache (engine core,
  and ``LLM.generate(..., priority=[...])``), and every preempted request still gives the tokens
  it gives alone;
* starvation: with a fake clock, a low-priority request facing a never-ending stream of
  high-priority arrivals finishes while the stream still runs, and does not without aging;
* no ping-pong: two requests never preempt each other back and forth through the waiting path
  (property test over arrival times, priorities and clock times; and in the engine, equal
  priorities never preempt each other at all).
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine import LLM, SamplingParams
from asyncengine.engine_core.core import EngineCore
from asyncengine.core.request import Request
from asyncengine.core.request_queue import PriorityQueue
import model_utils
from sched_oracle import Driver, new_sched
from sched_oracle import make_req as oracle_req

VOCAB = 512


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_core(tiny, **options) -> EngineCore:
    options.setdefault("policy", "priority")
    return model_utils.make_core(tiny, **options)


def req(rid: str, prompt, max_tokens: int, priority: int = 0, arrival_time: float | None = None) -> Request:
    kw = {} if arrival_time is None else {"arrival_time": arrival_time}
    return Request(request_id=rid, prompt_token_ids=list(prompt), max_tokens=max_tokens, priority=priority,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens), **kw)


class Run:
    """Steps a core; ``arrive(step)`` callbacks add requests; records outputs and finish order."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.outs: dict[str, list[int]] = {}
        self.finished: list[str] = []
        self.steps = 0

    def add(self, r: Request) -> None:
        self.core.add_request(r)
        self.outs[r.request_id] = []

    def step(self) -> None:
        for o in self.core.step():
            self.outs[o.req_id] += o.new_token_ids
            if o.finished:
                self.finished.append(o.req_id)
        self.steps += 1

    def until_idle(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not self.core.has_unfinished():
                assert self.core.kv.num_free_blocks == self.core.num_blocks
                return
            self.step()
        raise AssertionError("did not finish")


def alone(tiny, prompts: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
    """Each request's tokens with nothing else in the engine (and no prefix cache)."""
    core = make_core(tiny, num_kv_blocks=64, block_size=4, enable_prefix_caching=False, policy="fcfs")
    out = {}
    for rid, (p, m) in prompts.items():
        r = Run(core)
        r.add(req(rid, p, m))
        r.until_idle()
        out[rid] = r.outs[rid]
    return out


# ---------------------------------------------------------------------------- overtaking


@pytest.mark.parametrize("caching", [False, True])
def test_late_high_priority_overtakes_on_a_full_cache(tiny, caching):
    """Two low-priority requests fill the 10-block pool (two more wait for room). A high-priority
    request arriving at step 3 cannot get blocks, preempts the newest running low one, and finishes
    first; the preempted one still produces its solo tokens."""
    rng = random.Random(1)
    prompts = {f"low{i}": ([rng.randrange(3, VOCAB) for _ in range(12)], 20) for i in range(4)}
    prompts["high"] = ([rng.randrange(3, VOCAB) for _ in range(12)], 6)
    core = make_core(tiny, num_kv_blocks=10, block_size=4, max_num_seqs=4, enable_prefix_caching=caching)
    run = Run(core)
    for i in range(4):
        run.add(req(f"low{i}", *prompts[f"low{i}"], priority=5))
    for _ in range(3):
        run.step()
    st0 = core.stats()
    # 8 of 10 blocks held: no room for a third 12-token prompt (3 blocks)
    assert st0["num_running"] == 2 and st0["num_waiting"] == 2 and st0["num_free_kv_blocks"] == 2
    run.add(req("high", *prompts["high"], priority=0))
    run.until_idle()
    assert run.finished[0] == "high", run.finished
    assert core.stats()["num_preemptions"] >= 1
    assert run.outs == alone(tiny, prompts)


def test_llm_generate_priority_list(tiny):
    """Through ``LLM.generate(prompts, params, priority=[...])``: the last-listed, highest-priority
    prompt is served first (max_num_seqs=1, so the order is exactly priority order, ties by
    submission), and the tokens equal an FCFS run's."""
    model_dir, _ = tiny
    rng = random.Random(2)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 12))] for _ in range(5)]
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    priorities = [3, 3, 2, 3, 0]
    results = {}
    for policy in ("fcfs", "priority"):
        llm = LLM(model_dir, dtype="float32", policy=policy, num_kv_blocks=16, block_size=4, max_num_seqs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                            priority=priorities if policy == "priority" else None)
        results[policy] = outs
    assert [o.outputs[0].token_ids for o in results["fcfs"]] == [o.outputs[0].token_ids for o in results["priority"]]
    order = sorted(range(5), key=lambda i: results["priority"][i].metrics.first_token_time)
    assert order == [4, 2, 0, 1, 3]
    fcfs_order = sorted(range(5), key=lambda i: results["fcfs"][i].metrics.first_token_time)
    assert fcfs_order == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------------- starvation


@pytest.mark.parametrize("aging_s", [1.0, 0.0])
def test_low_priority_is_not_starved_by_a_stream_of_high_priority(tiny, aging_s):
    """One seat (max_num_seqs=1). A priority-3 request arrives at t=0; then two priority-0 requests
    (one step of work each) arrive every step, i.e. every 0.25 s of fake clock, twice as fast as
    they are served, for 40 steps. With aging (1 s per level) the low request gets through while
    the stream still flows: at time t the oldest waiting high request arrived at about t/2, so
    around t = 6 s both have aged to the same effective priority and the low one wins on arrival.
    Without aging (``priority_aging_s=0``) it is still waiting when the stream stops."""
    now = [0.0]
    core = make_core(tiny, num_kv_blocks=64, block_size=4, max_num_seqs=1, priority_aging_s=aging_s)
    core.scheduler.waiting.clock = lambda: now[0]
    run = Run(core)
    rng = random.Random(3)
    low = req("low", [rng.randrange(3, VOCAB) for _ in range(6)], 2, priority=3, arrival_time=now[0])
    run.add(low)
    for k in range(40):
        for j in range(2):
            run.add(req(f"high{2 * k + j}", [rng.randrange(3, VOCAB) for _ in range(4)], 1, priority=0,
                        arrival_time=now[0]))
        run.step()
        now[0] += 0.25
    backlog = core.stats()["num_waiting"]
    assert backlog >= 30  # the stream really outpaced the seat
    if aging_s:
        assert "low" in run.finished
        i = run.finished.index("low")
        assert i >= 10  # it did wait for a while: about 6 s / 0.25 s per step, minus its own steps
        # the high requests served right after it arrived after about 3 s (3 aging levels)
        assert all(int(r[4:]) * 0.125 >= 2.5 for r in run.finished[i + 1:])
    else:
        assert "low" not in run.finished and low.num_computed_tokens == 0
    core.abort_requests([r for r in run.outs if r not in run.finished])
    run.until_idle()


# ---------------------------------------------------------------------------- no ping-pong


@settings(max_examples=300, deadline=None)
@given(pa=st.integers(0, 4), pb=st.integers(0, 4), aa=st.floats(0, 20), ab=st.floats(0, 20),
       times=st.lists(st.floats(20, 100), min_size=2, max_size=6), aging=st.sampled_from([0.0, 0.7, 1.0, 5.0]))
def test_outranks_never_flips(pa, pb, aa, ab, times, aging):
    """At no two clock times can A outrank B and B outrank A: effective priorities of two requests
    age at the same rate, so their difference only takes two adjacent integer values, and strict
    outranking needs it to be negative one way and positive the other. Equal base priorities: the
    younger never outranks the older (so it never preempts it)."""
    now = [0.0]
    q = PriorityQueue(aging_s=aging, clock=lambda: now[0])
    a = req("a", [3], 1, priority=pa, arrival_time=aa)
    b = req("b", [3], 1, priority=pb, arrival_time=ab)
    a_over_b = b_over_a = False
    for t in sorted(times):
        now[0] = t
        ab_, ba_ = q.outranks(a, b), q.outranks(b, a)
        assert not (ab_ and ba_)
        assert not q.outranks(a, a)
        a_over_b |= ab_
        b_over_a |= ba_
        if pa == pb:
            young, old = (a, b) if aa > ab else (b, a)
            assert not q.outranks(young, old)
    assert not (a_over_b and b_over_a), "A and B could preempt each other back and forth"


@pytest.mark.parametrize("overlap", [False, True])
def test_equal_priorities_never_preempt_through_the_waiting_path(overlap):
    """max_num_seqs=1 and 4 equal-priority requests: whatever the clock does, a waiting request never
    takes the seat of a running one of the same priority; with a small pool, memory-pressure
    preemptions (of the newest) happen, and the older request is never the victim."""
    now = [0.0]
    s = new_sched(num_blocks=32, block_size=4, max_num_seqs=1, budget=8, clock=lambda: now[0])
    s.waiting.aging_s = 1.0
    d = Driver(s, overlap)
    reqs = [oracle_req(f"r{i}", list(range(10 + 20 * i, 22 + 20 * i)), 6, priority=2, arrival_time=float(i))
            for i in range(4)]
    for r in reqs:
        d.add(r)
    for _ in range(400):
        if not s.has_unfinished():
            break
        d.step()
        now[0] += 0.6
    d.run()
    d.check_done(reqs)
    assert s.stats.num_preemptions == 0 and d.finish_order == ["r0", "r1", "r2", "r3"]

    # two at a time on a pool too small for both: memory pressure preempts, always the newer one
    now[0] = 0.0
    s = new_sched(num_blocks=7, block_size=4, max_num_seqs=2, budget=16, clock=lambda: now[0])
    s.waiting.aging_s = 1.0
    d = Driver(s, overlap)
    old = oracle_req("old", list(range(10, 22)), 12, priority=1, arrival_time=0.0)
    new = oracle_req("new", list(range(40, 52)), 12, priority=1, arrival_time=0.5)
    d.add(old)
    d.add(new)
    for _ in range(400):
        if not s.has_unfinished():
            break
        d.step()
        now[0] += 0.3
    d.run()
    d.check_done([old, new])
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
