"""A fake model runner that checks the KV cache's *contents*, for scheduler + prefix-cache tests.

``KVOracleRunner`` plays the model runner for a real ``Scheduler`` + ``KVCacheManager``. It keeps
what every KV slot holds, as the id of the exact (cache salt, token prefix) whose last token was
computed into it, and per request the token ids it knows (prompt, resumed outputs and its own
samples), its computed count and its block table. Each step it

1. writes the slots of every scheduled position, for the whole batch first (as the real attention
   does: every layer stores the batch's K/V before any request reads), failing if two requests of
   one step write the same slot;
2. checks every scheduled request can *read* correct KV for all its positions so far: each slot it
   attends to holds exactly its own (salt, prefix). A prefix hit on a block nobody wrote, or one
   written for other tokens, or a block reused while someone still reads it, fails here;
3. "samples" a token for requests that reached the end of what they know. The token is a function
   of the whole (salt-free) token sequence, like greedy decoding, so identical contexts produce
   identical continuations (and generated tokens can be prefix-cache hits too).

``Driver`` steps the scheduler synchronously or overlapped by one step (as the async engine does:
step N+1 is scheduled before step N's tokens are folded back). After every step it asserts the
block bookkeeping (``check_accounting``) and that every block the prefix cache offers holds exactly
the KV its hash names (``KVOracleRunner.check_cached_contents``), even if nobody reads it again.

Requests with ``n > 1`` are fanned out by the scheduler into samples ``"<id>#<i>"``; the Driver
tracks (and ``check_done`` checks) every sample. The fake model is greedy, so each sample must
produce exactly what a single request with that prompt produces; a sample can be aborted alone.
"""
from __future__ import annotations

from asyncengine.config import EngineConfig
from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.request import Request, RequestStatus, child_request_id
from asyncengine.contracts.sched_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.core.scheduler import Scheduler
from asyncengine.sampling_params import SamplingParams


def next_token(tokens: list[int]) -> int:
    """The fake model's greedy choice: a small-alphabet function of the whole sequence."""
    h = 0
    for t in tokens:
        h = (h * 1000003 + t) & 0xFFFFFFFF
    return 3 + h % 7


def make_req(rid: str, prompt: list[int], max_tokens: int, priority: int = 0, salt: str | None = None,
             arrival_time: float | None = None, n: int = 1) -> Request:
    kw = {} if arrival_time is None else {"arrival_time": arrival_time}
    return Request(request_id=rid, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n),
                   max_tokens=max_tokens, priority=priority, cache_salt=salt, **kw)


def new_sched(num_blocks=32, block_size=4, max_num_seqs=4, budget=16, policy="priority", caching=True,
              clock=None, kv_connector=None) -> Scheduler:
    """A real scheduler + KV manager; ``clock`` replaces the priority queue's clock (aging)."""
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy).scheduler_config
    s = Scheduler(kv, config, max_model_len=num_blocks * block_size, kv_connector=kv_connector)
    if clock is not None:
        s.waiting.clock = clock
    return s


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks))
    return toks[len(prompt):]


class KVOracleRunner:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bs = sched.kv.block_size
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> prefix id written there
        self._ids: dict[tuple, int] = {}  # (parent prefix id, token, salt) -> prefix id
        self.state: dict[str, dict] = {}
        self.num_scheduled_prompt_tokens = 0  # prompt positions computed (recomputes included)

    def _prefix_ids(self, s: dict) -> list[int]:
        pids = s["pids"]
        toks = s["tokens"]
        while len(pids) < len(toks):
            key = (pids[-1] if pids else -1, toks[len(pids)], s["salt"])
            pids.append(self._ids.setdefault(key, len(self._ids)))
        return pids

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.state.pop(rid, None)
        for nr in so.new_requests:
            assert nr.req_id not in self.state, f"{nr.req_id} sent as new while the runner holds it"
            req = self.sched.requests[nr.req_id]
            self.state[nr.req_id] = dict(tokens=list(nr.prompt_token_ids) + list(nr.output_token_ids),
                                         n_prompt=len(nr.prompt_token_ids), computed=nr.num_computed_tokens,
                                         blocks=list(nr.block_ids), salt=req.cache_salt, pids=[])
        for cr in so.cached_requests:
            s = self.state[cr.req_id]
            assert s["computed"] == cr.num_computed_tokens, (cr.req_id, s["computed"], cr.num_computed_tokens)
            s["blocks"] += cr.new_block_ids
        # 1. the batch writes its K/V
        written: dict[tuple[int, int], str] = {}
        for rid, n in so.num_scheduled_tokens.items():
            s = self.state[rid]
            c = s["computed"]
            assert n >= 1 and c + n <= len(s["tokens"]), f"{rid}: asked to compute unknown tokens"
            assert c + n <= len(s["blocks"]) * self.bs, f"{rid}: no slot for a scheduled token"
            assert s["blocks"] == self.sched.kv.block_ids(rid), f"{rid}: runner and KV manager disagree"
            pids = self._prefix_ids(s)
            for p in range(c, c + n):
                slot = (s["blocks"][p // self.bs], p % self.bs)
                assert slot not in written, f"slot {slot} written by {written[slot]} and {rid} in one step"
                written[slot] = rid
                self.slots[slot] = pids[p]
            self.num_scheduled_prompt_tokens += max(0, min(c + n, s["n_prompt"]) - c)
        # 2. every scheduled request reads correct K/V for all its positions
        req_ids, toks = [], []
        for rid, n in so.num_scheduled_tokens.items():
            s = self.state[rid]
            pids = s["pids"]
            end = s["computed"] + n
            for p in range(end):
                got = self.slots.get((s["blocks"][p // self.bs], p % self.bs))
                assert got == pids[p], (f"{rid}: the KV at position {p} (block {s['blocks'][p // self.bs]}) "
                                        f"is not its own (computed {s['computed']}, scheduled {n})")
            s["computed"] = end
            # 3. sample at the end of the known tokens
            if end == len(s["tokens"]):
                t = next_token(s["tokens"])
                s["tokens"].append(t)
                req_ids.append(rid)
                toks.append(t)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[t] for t in toks])

    def check_cached_contents(self, reqs) -> None:
        """Every block the prefix cache offers under one of these requests' block hashes holds
        exactly the KV that hash names (written by some step already executed), whether or not
        anyone reads it later."""
        pool = self.sched.kv.pool
        for r in reqs:
            toks = r.all_token_ids
            pid = -1
            for i, h in enumerate(r.block_hashes):
                b = pool.cached.get(h)
                for j in range(self.bs):
                    pid = self._ids.get((pid, toks[i * self.bs + j], r.cache_salt), -2)
                    if b is not None:
                        assert self.slots.get((b.block_id, j)) == pid, (
                            f"cached block {b.block_id} (block {i} of {r.request_id}) does not hold the KV "
                            f"its hash names at slot {j}")


def check_accounting(s: Scheduler) -> None:
    """Every live request is in exactly one of running / waiting / held (an ``n > 1`` sample waiting
    for sample 0's prompt), and only running ones hold blocks; each block's ref count is the number
    of block tables holding it; free + held == all; the ``n > 1`` bookkeeping names exactly the live
    samples."""
    running = {r.request_id for r in s.running}
    waiting = {r.request_id for r in s.waiting}
    held = {r.request_id for r in s.samples.held}
    assert not running & waiting and not held & (running | waiting)
    assert running | waiting | held == set(s.requests)
    assert len(running) == len(s.running) and len(waiting) == len(s.waiting) and len(held) == len(s.samples.held)
    for r in s.running:
        assert r.status == RequestStatus.RUNNING and r.hold_for is None
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and r.hold_for is None
    for r in s.samples.held:
        # a sample 1..n-1 that never ran, waiting for sample 0 of its own request (released by the
        # next schedule() once that one has had its whole prompt or is gone)
        assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 0 and r.num_preemptions == 0
        assert r.parent_id is not None and r.request_id != child_request_id(r.parent_id, 0)
        assert r.hold_for.request_id == child_request_id(r.parent_id, 0)
    live_samples = {rid for rid, r in s.requests.items() if r.parent_id is not None}
    assert set().union(*s.samples.parents.values()) == live_samples if s.samples.parents else not live_samples
    for pid, kids in s.samples.parents.items():
        assert kids and all(s.requests[k].parent_id == pid for k in kids)
    assert set(s.kv.req_to_blocks) <= running, "a request that is not running holds blocks"
    holders: dict[int, int] = {}
    for table in s.kv.req_to_blocks.values():
        for b in table:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    assert all(b.ref_cnt == holders.get(b.block_id, 0) for b in s.kv.pool.blocks)
    assert s.kv.num_free_blocks + len(holders) == s.kv.pool.num_blocks
    s.kv.pool.check_invariants()


def check_no_running_request_skipped(s: Scheduler, so: SchedulerOutput) -> None:
    """Continuous batching: a step leaves out a running request only when it has nothing to compute
    now, when the token budget ran out, or when its next image's encoding did not fit the step."""
    if so.total_num_scheduled_tokens == s.max_num_batched_tokens:
        return
    for r in s.running:
        assert r.request_id in so.num_scheduled_tokens or s._tokens_to_schedule(r) == 0 \
            or r.request_id in s.encoder.deferred, (
            f"{r.request_id} was running with tokens to compute and budget left, but not scheduled")


class Driver:
    """Steps a scheduler with the oracle runner; records each request's outputs and finish reason."""

    def __init__(self, sched: Scheduler, overlap: bool = False) -> None:
        self.sched = sched
        self.runner = KVOracleRunner(sched)
        self.overlap = overlap
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.finish_order: list[str] = []
        self.seen: list[Request] = []
        self.num_steps = 0

    def add(self, req: Request) -> list[Request]:
        """Add a request; returns the core requests it became (its ``n`` samples, or itself)."""
        self.sched.add_request(req)
        kids = self.sched.samples.parents.get(req.request_id)
        core = [self.sched.requests[k] for k in sorted(kids)] if kids else [req]
        for r in core:
            self.outputs[r.request_id] = []
            self.seen.append(r)
        return core

    def abort(self, rids) -> list[str]:
        done = self.sched.abort_requests(rids)
        for rid in done:
            self.finish[rid] = "abort"
            self.finish_order.append(rid)
        return done

    def _update(self, so, out) -> None:
        for o in self.sched.update(so, out):
            assert o.req_id not in self.finish, f"output for {o.req_id} after it finished"
            self.outputs[o.req_id] += o.new_token_ids
            if o.finished:
                self.finish[o.req_id] = o.finish_reason
                self.finish_order.append(o.req_id)

    def step(self) -> SchedulerOutput:
        # held samples whose sample 0 has had its whole prompt (or is gone) must leave the hold now
        ready = [r for r in self.sched.samples.held if r.hold_for.is_finished
                 or r.hold_for.num_computed_tokens >= r.hold_for.num_prompt_tokens]
        so = self.sched.schedule()
        assert not set(map(id, ready)) & set(map(id, self.sched.samples.held)), "a ready sample is still held"
        check_no_running_request_skipped(self.sched, so)
        self.num_steps += 1
        assert so.total_num_scheduled_tokens <= self.sched.max_num_batched_tokens
        assert self.sched.num_running <= self.sched.max_num_seqs
        out = self.runner.execute(so)
        if self.overlap:
            prev, self.in_flight = self.in_flight, (so, out)
            if prev is not None:
                self._update(*prev)
        else:
            self._update(so, out)
        check_accounting(self.sched)
        self.runner.check_cached_contents(self.seen)
        return so

    def flush(self) -> None:
        if self.in_flight is not None:
            self._update(*self.in_flight)
            self.in_flight = None

    def run(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                self.flush()
                if not self.sched.has_unfinished():
                    return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: running {self.sched.num_running}, "
                             f"waiting {self.sched.num_waiting}")

    def check_done(self, reqs: list[Request]) -> None:
        """Everything finished and freed; each request (each sample of an ``n > 1`` one) finished once,
        with exactly the greedy continuation unless it was aborted."""
        s = self.sched
        assert not s.requests and not s.running and not len(s.waiting) and not s.samples.held and not s.samples.parents
        assert s.kv.num_free_blocks == s.kv.pool.num_blocks and not s.kv.req_to_blocks
        assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)
        assert len(self.finish_order) == len(set(self.finish_order)), "a request finished twice"
        samples = []
        for r in reqs:
            n = r.sampling_params.n
            samples += [r] if n == 1 else [c for c in self.seen if c.parent_id == r.request_id]
            assert n == 1 or len(samples[-n:]) == n and all(c.parent_id == r.request_id for c in samples[-n:])
        for r in samples:
            rid = r.request_id
            assert rid in self.finish, f"{rid} was lost"
            if self.finish[rid] == "abort":
                continue
            want = expected_output(r.prompt_token_ids, r.max_tokens)
            assert self.outputs[rid] == want, f"{rid}: {self.outputs[rid]} != {want}"
