"""Scheduler unit tests with a real KVCacheManager and a fake model runner.

The fake runner keeps per-request state exactly like ``ModelRunner`` (token ids as far as it knows
them, including its own latest samples; computed count; block table) and "samples" whenever a
request's scheduled tokens reach the end of what it knows. The k-th output token of every request
is ``TOK0 + k``, so an output list that is not exactly ``TOK0, TOK0+1, ...`` means a token was lost,
duplicated or reordered. It also checks the scheduler's messages: a request is only ever asked to
compute tokens the runner knows, into slots of blocks it was given, from the position the runner is
at, and the runner's block table always equals the KV manager's.

Two driving orders: synchronous (schedule N, execute N, update N) and overlapped, as the async
engine runs (schedule N+1 before update N, so step N+1 is planned on placeholders).
"""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncengine.config import EngineConfig
from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.request import Request, RequestStatus
from asyncengine.contracts.sched_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.core.scheduler import Scheduler
from asyncengine.sampling_params import SamplingParams
from sched_oracle import check_accounting, check_no_running_request_skipped  # shared checks

TOK0 = 100


def make_req(rid: str, prompt_len: int, max_tokens: int, eos_at: int | None = None, priority: int = 0,
             first: int = 3, n: int = 1) -> Request:
    """A request whose ``eos_at``-th output (0-based) is its EOS token (the fake runner's ``TOK0 + eos_at``);
    with ``n > 1`` the scheduler fans it out into ``n`` samples, each with those outputs."""
    eos = frozenset() if eos_at is None else frozenset({TOK0 + eos_at})
    return Request(request_id=rid, prompt_token_ids=[first + (i % 90) for i in range(prompt_len)],
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n), eos_token_ids=eos,
                   max_tokens=max_tokens, priority=priority)


class FakeRunner:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv = sched.kv
        self.bs = sched.kv.block_size
        self.state: dict[str, dict] = {}
        self.steps: list[SchedulerOutput] = []
        # the "KV cache": (block, slot) -> the token prefix whose last token's K/V was written there
        self.kv_slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        for rid in so.finished_req_ids:
            self.state.pop(rid, None)
        for nr in so.new_requests:
            assert nr.req_id not in self.state, f"{nr.req_id} sent as new while the runner holds it"
            self.state[nr.req_id] = dict(tokens=list(nr.prompt_token_ids) + list(nr.output_token_ids),
                                         n_prompt=len(nr.prompt_token_ids), computed=nr.num_computed_tokens,
                                         blocks=list(nr.block_ids),
                                         max_tokens=self.sched.requests[nr.req_id].max_tokens)
        for cr in so.cached_requests:
            s = self.state[cr.req_id]
            assert s["computed"] == cr.num_computed_tokens, (cr.req_id, s["computed"], cr.num_computed_tokens)
            s["blocks"] += cr.new_block_ids
        assert set(so.num_scheduled_tokens) == {r.req_id for r in so.new_requests} | {
            r.req_id for r in so.cached_requests}
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        req_ids, toks = [], []
        for rid, n in so.num_scheduled_tokens.items():
            s = self.state[rid]
            assert n >= 1
            assert s["blocks"] == self.kv.block_ids(rid), f"{rid}: runner and KV manager disagree on blocks"
            assert s["computed"] + n <= len(s["tokens"]), f"{rid}: asked to compute tokens nobody knows yet"
            assert s["computed"] + n <= len(s["blocks"]) * self.bs, f"{rid}: no slot for a scheduled token"
            known, blocks, bs = s["tokens"], s["blocks"], self.bs
            for pos in range(s["computed"]):  # the context attended to holds this request's own K/V
                assert self.kv_slots.get((blocks[pos // bs], pos % bs)) == tuple(known[:pos + 1]), (
                    f"{rid}: position {pos} reads K/V that was never computed for this prefix")
            for pos in range(s["computed"], s["computed"] + n):
                self.kv_slots[(blocks[pos // bs], pos % bs)] = tuple(known[:pos + 1])
            s["computed"] += n
            if s["computed"] == len(s["tokens"]):
                k = len(s["tokens"]) - s["n_prompt"]
                assert k < s["max_tokens"], f"{rid}: sampled past max_tokens"
                s["tokens"].append(TOK0 + k)
                req_ids.append(rid)
                toks.append(TOK0 + k)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[t] for t in toks])


def new_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, caching=True, policy="fcfs",
                  chunked=True) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy,
                          enable_chunked_prefill=chunked).scheduler_config
    sched = Scheduler(kv, config, max_model_len=num_blocks * block_size)
    return sched, FakeRunner(sched)


class Driver:
    """Steps a scheduler with the fake runner, synchronously or one step overlapped; records outputs."""

    def __init__(self, sched: Scheduler, runner: FakeRunner, overlap: bool = False) -> None:
        self.sched, self.runner, self.overlap = sched, runner, overlap
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.num_steps = 0
        self.samples: dict[str, list[Request]] = {}  # n > 1: user id -> its samples

    def add(self, req: Request) -> list[Request]:
        """Add a request; returns the core requests it became (its ``n`` samples, or itself)."""
        self.sched.add_request(req)
        kids = self.sched.samples.parents.get(req.request_id)
        core = [self.sched.requests[k] for k in sorted(kids)] if kids else [req]
        if kids:
            self.samples[req.request_id] = core
        for r in core:
            self.outputs[r.request_id] = []
        return core

    def abort(self, rids) -> list[str]:
        done = self.sched.abort_requests(rids)
        for rid in done:
            assert rid not in self.finish
            self.finish[rid] = "abort"
        return done

    def _update(self, so, out) -> None:
        for o in self.sched.update(so, out):
            assert o.req_id not in self.finish, f"output for {o.req_id} after it finished"
            self.outputs[o.req_id] += o.new_token_ids
            if o.finished:
                self.finish[o.req_id] = o.finish_reason

    def step(self) -> SchedulerOutput:
        s = self.sched
        so = s.schedule()
        check_no_running_request_skipped(s, so)
        self.num_steps += 1
        assert so.total_num_scheduled_tokens <= s.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= s.max_num_seqs and s.num_running <= s.max_num_seqs
        out = self.runner.execute(so)
        if self.overlap:
            prev, self.in_flight = self.in_flight, (so, out)
            if prev is not None:
                self._update(*prev)
        else:
            self._update(so, out)
        check_accounting(s)
        return so

    def idle(self) -> bool:
        return not self.sched.has_unfinished() and (not self.overlap or self.in_flight is None
                                                    or self.in_flight[0].is_empty)

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if self.idle():
                return
            self.step()
            if self.overlap and not self.sched.has_unfinished() and self.in_flight is not None:
                self._update(*self.in_flight)
                self.in_flight = None
        raise AssertionError(f"not finished after {max_steps} steps: running {self.sched.num_running}, "
                             f"waiting {self.sched.num_waiting}")


def expected_tokens(n: int) -> list[int]:
    return [TOK0 + k for k in range(n)]


def check_all_done(d: Driver, reqs: list[Request]) -> None:
    s = d.sched
    assert not s.requests and not s.running and not len(s.waiting) and not s.samples.held and not s.samples.parents
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks and not s.kv.req_to_blocks
    for r in [c for r in reqs for c in d.samples.get(r.request_id, [r])]:
        rid = r.request_id
        assert rid in d.finish, f"{rid} was lost"
        assert d.outputs[rid] == expected_tokens(len(d.outputs[rid])), f"{rid}: {d.outputs[rid]}"
        assert r.output_token_ids == d.outputs[rid]
        if d.finish[rid] == "length":
            assert len(d.outputs[rid]) == r.max_tokens
        elif d.finish[rid] == "stop":
            (eos,) = r.eos_token_ids
            assert d.outputs[rid][-1] == eos and eos not in d.outputs[rid][:-1]


# ---------------------------------------------------------------------------- budget and batch size


@pytest.mark.parametrize("overlap", [False, True])
def test_budget_and_max_num_seqs(overlap):
    sched, runner = new_scheduler(budget=16, max_num_seqs=3)
    d = Driver(sched, runner, overlap)
    reqs = [make_req(f"r{i}", 5 + 4 * i, 3 + i % 4, first=3 + 7 * i) for i in range(10)]
    for r in reqs:
        d.add(r)
    d.run()
    check_all_done(d, reqs)
    assert all(d.finish[r.request_id] == "length" for r in reqs)
    assert max(so.total_num_scheduled_tokens for so in runner.steps) == 16  # the budget is used, not exceeded
    assert max(len(so.num_scheduled_tokens) for so in runner.steps) == 3


def test_chunked_prefill_splits_long_prompt():
    sched, runner = new_scheduler(budget=16)
    d = Driver(sched, runner)
    r = make_req("long", 50, 3)
    d.add(r)
    d.run()
    check_all_done(d, [r])
    sizes = [so.num_scheduled_tokens.get("long") for so in runner.steps if "long" in so.num_scheduled_tokens]
    assert sizes == [16, 16, 16, 2, 1, 1]
    assert len(runner.steps[0].new_requests) == 1 and runner.steps[1].cached_requests[0].num_computed_tokens == 16
    assert sched.stats.num_scheduled_tokens == 52


def test_chunked_prefill_disabled_waits_for_room():
    sched, runner = new_scheduler(budget=16, chunked=False)
    d = Driver(sched, runner)
    a, b = make_req("a", 12, 4), make_req("b", 12, 4, first=50)
    d.add(a)
    d.add(b)
    so = d.step()
    assert so.num_scheduled_tokens == {"a": 12}  # b does not fit the 4 tokens left: it waits, unchunked
    so = d.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 12}  # now it fits whole
    d.run()
    check_all_done(d, [a, b])
    assert all(n in (1, 12) for so in runner.steps for n in so.num_scheduled_tokens.values())


def test_decodes_and_prefill_chunk_in_one_step():
    sched, runner = new_scheduler(budget=16)
    d = Driver(sched, runner)
    a = make_req("a", 4, 10)
    d.add(a)
    d.step()
    d.step()  # a decodes
    b = make_req("b", 40, 2)
    d.add(b)
    so = d.step()
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]  # running first, then a chunk
    so = d.step()
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]
    assert [c.req_id for c in so.cached_requests] == ["a", "b"]
    d.run()
    check_all_done(d, [a, b])


# ---------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_by_recompute(overlap):
    # 6 blocks of 4 = 24 slots; three requests of 6 + 10 tokens (4 blocks each) cannot all run
    sched, runner = new_scheduler(num_blocks=6, block_size=4, budget=32, caching=False)
    d = Driver(sched, runner, overlap)
    reqs = [make_req(f"r{i}", 6, 10, first=3 + 10 * i) for i in range(4)]
    for r in reqs:
        d.add(r)
    seen_front = False
    for _ in range(500):
        if d.idle():
            break
        before = list(sched.running)
        so = d.step()
        if so.num_preempted:
            victims = [r for r in before if r.status == RequestStatus.PREEMPTED]
            assert victims and all(v.request_id in so.finished_req_ids for v in victims)
            assert victims[-1] is before[-1]  # fcfs: the newest running request loses its blocks
            assert list(sched.waiting)[:len(victims)] == victims  # ...and waits at the front, in order
            assert all(v.num_computed_tokens == 0 and not sched.kv.req_to_blocks.get(v.request_id) for v in victims)
            assert not so.new_requests  # nothing admitted in a step that preempted
            seen_front = True
        if d.overlap and not sched.has_unfinished() and d.in_flight is not None:
            d._update(*d.in_flight)
            d.in_flight = None
    assert seen_front and sched.stats.num_preemptions > 0
    check_all_done(d, reqs)
    assert all(d.finish[r.request_id] == "length" for r in reqs)
    resumed = [nr for so in runner.steps for nr in so.new_requests if nr.output_token_ids]
    assert resumed, "a preempted request resumes with its outputs so far"
    assert sum(r.num_preemptions for r in reqs) == sched.stats.num_preemptions


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("num_blocks", [2, 3, 5])
def test_tiny_pool_no_deadlock(num_blocks, overlap):
    bs = 4
    cap = num_blocks * bs
    sched, runner = new_scheduler(num_blocks=num_blocks, block_size=bs, budget=8, max_num_seqs=4)
    d = Driver(sched, runner, overlap)
    reqs = []
    for i in range(8):
        p = 1 + (3 * i) % (cap - 1)
        reqs.append(make_req(f"r{i}", p, max(1, min(cap - p, 1 + i)), first=3 + i))
    for r in reqs:
        d.add(r)
    d.run(max_steps=3000)
    check_all_done(d, reqs)


def test_priority_preempting_a_scheduled_chunk_uncaches_its_blocks():
    """A victim taken back out of the step being built had registered the blocks its chunk would
    fill as cached; their K/V is never written, so a later prefix hit must not be served from them
    (the fake runner checks every context slot it attends to was written for that very prefix)."""
    sched, runner = new_scheduler(num_blocks=4, block_size=4, budget=8, policy="priority")
    d = Driver(sched, runner)
    v = make_req("v", 14, 2, priority=2)
    d.add(v)
    d.step()  # v: positions 0-7 (blocks 0, 1 written)
    h = make_req("h", 3, 1, priority=0, first=60)
    d.add(h)
    so = d.step()  # v's last chunk (8-13) takes the last 2 blocks, then h outranks v and takes its place
    assert so.num_preempted == 0 and "v" in so.finished_req_ids and so.num_scheduled_tokens == {"h": 3}
    assert v.status == RequestStatus.PREEMPTED and sched.stats.num_preemptions == 1
    d.run()
    check_all_done(d, [v, h])
    (resumed,) = [nr for so in runner.steps[2:] for nr in so.new_requests if nr.req_id == "v"]
    assert resumed.num_computed_tokens == 8  # blocks 0 and 1 served from the cache, block 2 recomputed
    assert v.num_cached_tokens == 0  # what its first admission found; a recompute's hits do not count


def test_priority_victim_before_the_growing_request_skips_no_one():
    """Phase 1 under the priority policy: the request that needs a block (b) preempts the worst
    running one (a), which sits *before* it in the running list; the requests after b (c) are
    still scheduled in that step."""
    sched, runner = new_scheduler(num_blocks=4, block_size=4, budget=32, policy="priority")
    d = Driver(sched, runner)
    a = make_req("a", 3, 8, priority=5)
    d.add(a)
    d.step()  # a: positions 0-2 (block 1 of 4)
    b, c = make_req("b", 4, 4, priority=0, first=40), make_req("c", 3, 4, priority=0, first=60)
    d.add(b)
    d.add(c)
    d.step()  # a decodes; b and c are admitted: one block each, one block left
    assert [r.request_id for r in sched.running] == ["a", "b", "c"] and sched.kv.num_free_blocks == 1
    so = d.step()  # a takes the last block for position 4; b needs one for its position 4: a is the victim
    assert so.num_preempted == 1 and a.status == RequestStatus.PREEMPTED
    assert so.num_scheduled_tokens == {"b": 1, "c": 1}
    d.run()
    check_all_done(d, [a, b, c])


def test_priority_victim_keeps_its_chunk_when_a_hit_relies_on_it():
    """If a request admitted in this step already hit the blocks a scheduled victim's chunk fills,
    the victim is not taken back out of the step (the hit needs those blocks written)."""
    sched, runner = new_scheduler(num_blocks=6, block_size=4, budget=12, policy="priority")
    d = Driver(sched, runner)
    v = make_req("v", 20, 2, priority=2)
    d.add(v)
    d.step()  # v: positions 0-11
    a = make_req("a", 18, 2, priority=0)
    a.prompt_token_ids[17] = 99  # shares v's first 17 tokens: hits blocks 0-3, block 3 written this step
    h = make_req("h", 3, 2, priority=1, first=60)
    d.add(a)
    d.add(h)
    so = d.step()
    assert so.num_scheduled_tokens == {"v": 8, "a": 2} and not so.num_preempted
    (na,) = so.new_requests
    assert na.req_id == "a" and na.num_computed_tokens == 16
    assert v.status == RequestStatus.RUNNING and h.status == RequestStatus.WAITING
    d.run()
    check_all_done(d, [v, a, h])


# ---------------------------------------------------------------------------- abort


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_frees_blocks(overlap):
    sched, runner = new_scheduler(budget=64, max_num_seqs=2)
    d = Driver(sched, runner, overlap)
    reqs = [make_req(f"r{i}", 10, 8, first=3 + 10 * i) for i in range(3)]
    for r in reqs:
        d.add(r)
    d.step()
    d.step()
    assert sched.kv.req_to_blocks.get("r0") and reqs[2].status == RequestStatus.WAITING
    free_before = sched.kv.num_free_blocks
    held = len(sched.kv.req_to_blocks["r0"])
    assert d.abort(["r0", "r2", "nope"]) == ["r0", "r2"]
    assert sched.kv.num_free_blocks == free_before + held and "r0" not in sched.kv.req_to_blocks
    assert reqs[0].status == RequestStatus.FINISHED_ABORTED and reqs[2].status == RequestStatus.FINISHED_ABORTED
    assert d.abort(["r0"]) == []  # twice: nothing to do
    so = d.step()
    assert {"r0", "r2"} <= set(so.finished_req_ids) and "r0" not in runner.state
    assert "r0" not in so.num_scheduled_tokens
    d.run()
    check_all_done(d, [reqs[1]])
    assert d.finish == {"r0": "abort", "r2": "abort", "r1": "length"}
    # synchronous: r0 had its 2 tokens; overlapped: step 2's token was in flight at the abort, and dropped
    assert d.outputs["r0"] == reqs[0].output_token_ids == expected_tokens(1 if overlap else 2)


# ---------------------------------------------------------------------------- async placeholders


def test_async_placeholders_reconcile():
    """Step N+1 is scheduled before step N's token is known; the counts reconcile as tokens land."""
    sched, runner = new_scheduler(budget=32)
    r = make_req("a", 5, 4)
    sched.add_request(r)

    def state():
        return r.num_computed_tokens, r.num_output_placeholders, list(r.output_token_ids)

    so1 = sched.schedule()
    out1 = runner.execute(so1)  # prefill: samples output #0
    assert state() == (5, 1, [])
    so2 = sched.schedule()  # planned on the placeholder: decode the token step 1 is producing
    assert so2.num_scheduled_tokens == {"a": 1} and so2.cached_requests[0].num_computed_tokens == 5
    assert state() == (6, 2, [])
    out2 = runner.execute(so2)
    outs = sched.update(so1, out1)
    assert [(o.req_id, o.new_token_ids, o.finished) for o in outs] == [("a", [TOK0], False)]
    assert state() == (6, 1, [TOK0])
    so3 = sched.schedule()
    out3 = runner.execute(so3)
    assert state() == (7, 2, [TOK0])
    sched.update(so2, out2)
    assert state() == (7, 1, expected_tokens(2))
    so4 = sched.schedule()  # 2 known + 1 in flight < 4: one more decode
    out4 = runner.execute(so4)
    assert so4.num_scheduled_tokens == {"a": 1} and state() == (8, 2, expected_tokens(2))
    sched.update(so3, out3)
    so5 = sched.schedule()  # 3 known + 1 in flight == max_tokens: nothing to schedule
    assert so5.is_empty and state() == (8, 1, expected_tokens(3))
    outs = sched.update(so4, out4)
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([TOK0 + 3], "length")]
    assert state() == (8, 0, expected_tokens(4)) and r.status == RequestStatus.FINISHED_LENGTH
    assert not sched.requests and sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    assert "a" in sched.schedule().finished_req_ids


def test_async_placeholders_sequence():
    """Step by step: computed counts run ahead of known tokens by exactly the placeholders."""
    sched, runner = new_scheduler(budget=32)
    r = make_req("a", 5, 4)
    d = Driver(sched, runner, overlap=True)
    d.add(r)
    trace = []
    while not d.idle():
        d.step()
        trace.append((r.num_computed_tokens, len(r.output_token_ids), r.num_output_placeholders,
                      r.status.name))
        if not sched.has_unfinished() and d.in_flight is not None:
            d._update(*d.in_flight)
            d.in_flight = None
    assert d.outputs["a"] == expected_tokens(4) and d.finish["a"] == "length"
    # step 1: prefill (5 computed, 1 placeholder); each later step decodes one placeholder while the
    # previous step's token lands; the last sample (output #4) is never fed back
    assert trace[:4] == [(5, 0, 1, "RUNNING"), (6, 1, 1, "RUNNING"), (7, 2, 1, "RUNNING"), (8, 3, 1, "RUNNING")]
    check_all_done(d, [r])


def test_stop_at_step_n_discards_step_n_plus_1():
    sched, runner = new_scheduler(budget=32)
    r = make_req("a", 5, 10, eos_at=1)  # the 2nd output is EOS
    other = make_req("b", 6, 3, first=50)
    sched.add_request(r)
    sched.add_request(other)
    so1 = sched.schedule()
    out1 = runner.execute(so1)  # prefill -> TOK0
    so2 = sched.schedule()
    out2 = runner.execute(so2)  # decode -> TOK0+1 (EOS)
    sched.update(so1, out1)
    so3 = sched.schedule()  # planned before step 2's EOS is known
    assert so3.num_scheduled_tokens["a"] == 1
    out3 = runner.execute(so3)  # decode -> TOK0+2, wasted
    assert "a" in out3.req_ids
    outs = sched.update(so2, out2)
    (oa,) = [o for o in outs if o.req_id == "a"]
    assert oa.finish_reason == "stop" and oa.new_token_ids == [TOK0 + 1]
    assert r.status == RequestStatus.FINISHED_STOPPED and "a" not in sched.requests
    assert "a" not in sched.kv.req_to_blocks
    outs = sched.update(so3, out3)
    assert all(o.req_id != "a" for o in outs), "the step after the stop leaked an output"
    assert r.output_token_ids == [TOK0, TOK0 + 1]
    assert other.output_token_ids == expected_tokens(3) and other.status == RequestStatus.FINISHED_LENGTH
    so4 = sched.schedule()
    assert {"a", "b"} <= set(so4.finished_req_ids) and so4.is_empty
    assert not sched.requests and sched.kv.num_free_blocks == sched.kv.pool.num_blocks


def test_preempted_with_token_in_flight_waits_for_it():
    """Overlapped: a request preempted while its step-N token is in flight is not re-admitted before
    that token lands (its recompute must include it)."""
    sched, runner = new_scheduler(num_blocks=4, block_size=4, budget=32, caching=False)
    a = make_req("a", 4, 8, first=3)
    b = make_req("b", 4, 8, first=40)
    sched.add_request(a)
    sched.add_request(b)
    pending = []
    preempted_with_placeholder = False
    for _ in range(200):
        if not sched.has_unfinished():
            break
        so = sched.schedule()
        for v in (a, b):
            if v.status == RequestStatus.PREEMPTED and v.num_output_placeholders:
                preempted_with_placeholder = True
                assert v.request_id not in so.num_scheduled_tokens
        pending.append((so, runner.execute(so)))
        if len(pending) == 2:
            sched.update(*pending.pop(0))
    for p in pending:
        sched.update(*p)
    assert preempted_with_placeholder
    assert a.output_token_ids == expected_tokens(8) and b.output_token_ids == expected_tokens(8)
    assert sched.kv.num_free_blocks == 4


@pytest.mark.parametrize("caching", [False, True])
def test_priority_preemption_with_token_in_flight_is_not_readmitted_in_that_step(caching):
    """The in-flight guard (a preempted request whose token is still in flight waits for it before
    re-admission) under the policy that needs it: priority, overlapped. ``v`` knows 12 tokens (3 full
    blocks) and its 13th is in flight; the step being built gives it a 4th block for that token, then
    ``high`` needs a block and takes ``v``'s (``_preempt_lower``). ``v``'s known tokens fit the 3 blocks
    and the budget left, so without the guard it is re-admitted at once and recomputes them *without*
    the one in flight: the runner samples that token a second time, the request's counts desync and
    it never finishes (the step cap fails the test)."""
    sched, runner = new_scheduler(num_blocks=4, block_size=4, budget=16, max_num_seqs=2, caching=caching,
                                  policy="priority")
    d = Driver(sched, runner, overlap=True)
    v = make_req("v", 8, 8, priority=5)  # 8 + 8 tokens: fits the 4 blocks alone
    d.add(v)
    for _ in range(5):
        d.step()  # prefill 0-7, decodes of 8-11; the token sampled at 11 is in flight
    assert len(v.output_token_ids) == 4 and v.num_output_placeholders == 1
    assert len(sched.kv.req_to_blocks["v"]) == 3 and sched.kv.num_free_blocks == 1
    high = make_req("high", 3, 3, priority=0, first=60)
    d.add(high)
    so = d.step()
    assert v.num_preemptions == 1 and "v" in so.finished_req_ids
    assert so.num_scheduled_tokens == {"high": 3}, "v re-admitted while its token was in flight"
    d.run(max_steps=200)
    check_all_done(d, [v, high])
    assert d.finish == {"v": "length", "high": "length"}

def test_request_ids_in_use_are_refused():
    """The core refuses an id that is in the engine, whether it names a request, an ``n > 1`` request
    or one of its samples ("<id>#<i>"), and leaves what is there untouched; an id is free again
    once its request (all its samples) finished."""
    sched, runner = new_scheduler()
    d = Driver(sched, runner)
    a, pair = make_req("a", 5, 2), make_req("p", 5, 2, n=2)
    d.add(a)
    d.add(pair)
    for dup in (make_req("a", 3, 1), make_req("a", 3, 1, n=2), make_req("p", 3, 1), make_req("p#1", 3, 1)):
        with pytest.raises(ValueError, match="already in the engine"):
            sched.add_request(dup)
    clash = make_req("q#0", 3, 1)  # a plain request whose id is the first sample id of "q" (n = 2)
    d.add(clash)
    with pytest.raises(ValueError, match="already in the engine"):
        sched.add_request(make_req("q", 3, 1, n=2))
    assert "q" not in sched.samples.parents and "q#1" not in sched.requests  # refused whole
    assert set(sched.requests) == {"a", "p#0", "p#1", "q#0"}
    d.run()
    check_all_done(d, [a, pair, clash])
    sched.add_request(make_req("a", 3, 1))  # free again
    assert "a" in sched.requests

def test_min_tokens_holds_off_eos_and_stop_ids_in_the_core():
    """The core's stop rule itself (not only the sampler's ban on EOS / stop ids, which a runner
    may not apply): an EOS or stop id among the first min_tokens outputs does not end a request;
    after that it does."""
    sched, runner = new_scheduler()
    d = Driver(sched, runner)
    eos = make_req("eos", 5, 8, eos_at=1)  # EOS is output #1 only
    eos.sampling_params = msgspec.structs.replace(eos.sampling_params, min_tokens=3)
    stop = make_req("stop", 5, 8, first=40)
    stop.sampling_params = msgspec.structs.replace(stop.sampling_params, min_tokens=3,
                                                   stop_token_ids=[TOK0 + 1, TOK0 + 4])
    d.add(eos)
    d.add(stop)
    d.run()
    assert d.finish == {"eos": "length", "stop": "stop"}
    assert d.outputs["eos"] == expected_tokens(8)
    assert d.outputs["stop"] == expected_tokens(5) and stop.stop_reason == TOK0 + 4

# ---------------------------------------------------------------------------- random workloads

ADD = st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.one_of(st.none(), st.integers(0, 11)),
                st.integers(0, 2), st.sampled_from([1, 1, 1, 2, 3]))
EVENT = st.one_of(ADD, ADD, ADD, st.tuples(st.just("step"), st.integers(1, 4)),
                  st.tuples(st.just("abort"), st.integers(0, 50)))


@pytest.mark.parametrize("overlap", [False, True])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(EVENT, min_size=6, max_size=40), num_blocks=st.integers(3, 12),
       budget=st.integers(1, 24), max_num_seqs=st.integers(1, 5), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_random_workload(overlap, events, num_blocks, budget, max_num_seqs, caching, policy):
    bs = 4
    cap = num_blocks * bs
    sched, runner = new_scheduler(num_blocks=num_blocks, block_size=bs, budget=budget,
                                  max_num_seqs=max_num_seqs, caching=caching, policy=policy)
    d = Driver(sched, runner, overlap)
    reqs: list[Request] = []
    ids: list[str] = []  # what an abort may name: user ids and single samples' ids
    for ev in events:
        if ev[0] == "add":
            _, plen, max_tokens, eos_at, prio, n = ev
            plen = min(plen, cap - 1)  # what the input processor guarantees: prompt + outputs fit the pool
            max_tokens = max(1, min(max_tokens, cap - plen))
            # shared first tokens, so prefix hits happen
            r = make_req(f"r{len(reqs)}", plen, max_tokens, eos_at=eos_at, priority=prio, first=3 + len(reqs) % 3,
                         n=n)
            reqs.append(r)
            samples = d.add(r)
            ids += [r.request_id] + ([c.request_id for c in samples] if n > 1 else [])
        elif ev[0] == "abort":
            if ids:
                d.abort([ids[ev[1] % len(ids)]])
        else:
            for _ in range(ev[1]):
                d.step()
    d.run(max_steps=3000)
    check_all_done(d, reqs)
    assert sched.stats.num_finished == sum(len(d.samples.get(r.request_id, [r])) for r in reqs)
