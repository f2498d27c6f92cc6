"""The scheduler: continuous (iteration-level) batching under a token budget.

There are no prefill and decode phases. Every request has ``num_computed_tokens`` catching up with
its token count; each step gives running requests their next tokens first (a decode is one token, a
long prompt a chunk of whatever budget is left), then admits waiting requests while budget, sequence
slots and KV blocks last. When blocks run out, the policy's victim is preempted by recompute: its
blocks are freed and it waits again at the front. Nothing is admitted in a step that preempted.

Async scheduling: ``num_computed_tokens`` advances when a step is scheduled and each step that will
sample adds an output placeholder, so step N+1 can be planned before step N's tokens are known.
"""
from __future__ import annotations

import time

from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.request import Request, RequestStatus
from asyncengine.core.request_queue import make_queue
from asyncengine.core.sched_output import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                                           NewRequestData, SchedulerOutput)


class SchedulerStats:
    __slots__ = ("num_preemptions", "num_steps", "num_scheduled_tokens", "num_finished", "queue_time_s_total",
                 "num_started")

    def __init__(self) -> None:
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_scheduled_tokens = 0
        self.num_finished = 0
        self.queue_time_s_total = 0.0
        self.num_started = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs", enable_chunked_prefill: bool = True,
                 priority_aging_s: float = 10.0) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting = make_queue(policy, priority_aging_s)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # to tell the runner at the next schedule()
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ requests in / out

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        self.requests[req.request_id] = req
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

    def abort_requests(self, request_ids) -> list[str]:
        """Abort whatever of ``request_ids`` is still here; returns the ids actually aborted."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            done.append(rid)
        return done

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif not req.status.finished:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
        self.stats.num_finished += 1

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.push_front(req)
        self._finished_ids.append(req.request_id)

    # ------------------------------------------------------------------ one step

    def _unschedule(self, victim: Request, num_scheduled: dict, new_blocks: dict, new_reqs: list) -> int:
        """Take a request out of the step being built; returns the budget it gave back."""
        new_blocks.pop(victim.request_id, None)
        if victim in new_reqs:
            new_reqs.remove(victim)
        return num_scheduled.pop(victim.request_id, 0)

    def _preempt_lower(self, req: Request, num_scheduled: dict, new_blocks: dict, new_reqs: list) -> bool:
        """Priority policy: preempt the worst running request if waiting ``req`` strictly
        outranks it (both ranks aged). Returns whether anything was preempted."""
        if not self.running:
            return False
        victim = self.waiting.pick_victim(self.running)
        if not self.waiting.outranks(req, victim):
            return False
        self._unschedule(victim, num_scheduled, new_blocks, new_reqs)
        self._preempt(victim)
        return True

    def _tokens_to_schedule(self, req: Request) -> int:
        """Tokens the request could compute now: the rest of its prompt/recompute, or one decode."""
        n = req.num_tokens_with_placeholders - req.num_computed_tokens
        if n > 0 and req.num_computed_tokens + n >= req.num_tokens_with_placeholders:
            # this step would sample: only if another output token is still wanted
            if len(req.output_token_ids) + req.num_output_placeholders >= req.max_tokens:
                return 0
        return n

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        new_reqs: list[Request] = []
        preempted = 0

        # 1. running requests, in order
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(self._tokens_to_schedule(req), budget)
            if n <= 0:
                i += 1
                continue
            while True:
                blocks = self.kv.allocate_slots(req, n)
                if blocks is not None:
                    break
                victim = self.waiting.pick_victim(self.running)
                vi = self.running.index(victim)
                budget += self._unschedule(victim, num_scheduled, new_blocks, new_reqs)
                self._preempt(victim)
                preempted += 1
                if vi < i:
                    i -= 1
                if victim is req:
                    break
            if blocks is None:
                continue  # req itself was preempted; running[i] is now the next request
            num_scheduled[req.request_id] = n
            new_blocks[req.request_id] = [b.block_id for b in blocks]
            budget -= n
            i += 1

        # 2. waiting requests, unless this step had to preempt for running ones
        priority = self.policy == "priority"
        if not preempted:
            while len(self.waiting) and budget > 0:
                req = self.waiting.peek()
                if req.num_output_placeholders:
                    break  # a token of it is still in flight from before its preemption
                if len(self.running) >= self.max_num_seqs:
                    if not (priority and self._preempt_lower(req, num_scheduled, new_blocks, new_reqs)):
                        break
                    budget = self.max_num_batched_tokens - sum(num_scheduled.values())
                    continue
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
                n = req.num_tokens - num_hit
                if n > budget:
                    if not self.enable_chunked_prefill:
                        break
                    n = budget
                blocks = self.kv.allocate_slots(req, n, hit_blocks)
                if blocks is None:
                    # priority policy: a better waiting request may take a worse one's blocks
                    if priority and self._preempt_lower(req, num_scheduled, new_blocks, new_reqs):
                        budget = self.max_num_batched_tokens - sum(num_scheduled.values())
                        continue
                    break
                self.waiting.pop()
                if self.kv.enable_caching:
                    self.kv.record_prefix_lookup(req.num_tokens, num_hit)
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = num_hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.monotonic()
                    self.stats.queue_time_s_total += req.first_scheduled_time - req.arrival_time
                    self.stats.num_started += 1
                self.running.append(req)
                new_reqs.append(req)
                num_scheduled[req.request_id] = n
                budget -= n

        # 3. build the message and advance the computed counts (async scheduling)
        new_ids = {r.request_id for r in new_reqs}
        new_data: list[NewRequestData] = []
        cached_data: list[CachedRequestData] = []
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            if rid in new_ids:
                new_data.append(NewRequestData(
                    req_id=rid, prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=list(req.output_token_ids), sampling_params=req.sampling_params,
                    block_ids=self.kv.block_ids(rid), num_computed_tokens=req.num_computed_tokens,
                    eos_token_ids=sorted(req.eos_token_ids), bad_words_token_ids=req.bad_words_token_ids))
            else:
                cached_data.append(CachedRequestData(req_id=rid, new_block_ids=new_blocks[rid],
                                                     num_computed_tokens=req.num_computed_tokens))
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens_with_placeholders:
                req.num_output_placeholders += 1
        total = sum(num_scheduled.values())
        finished, self._finished_ids = self._finished_ids, []
        self.stats.num_steps += total > 0
        self.stats.num_scheduled_tokens += total
        return SchedulerOutput(new_requests=new_data, cached_requests=cached_data,
                               num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=total,
                               finished_req_ids=finished, num_preempted=preempted)

    # ------------------------------------------------------------------ results back

    def update(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Fold a finished step's sampled tokens into request states; emit per-request outputs."""
        outputs: list[EngineCoreOutput] = []
        logprobs = out.logprobs
        prompt_lps = out.prompt_logprobs or {}
        for j, (rid, tok) in enumerate(zip(out.req_ids, out.sampled_token_ids)):
            req = self.requests.get(rid)
            if req is None:
                continue  # finished or aborted while this step was in flight
            req.num_output_placeholders -= 1
            req.output_token_ids.append(tok)
            status = req.check_stop(tok)
            lp = logprobs[j] if logprobs is not None else None
            outputs.append(EngineCoreOutput(
                req_id=rid, new_token_ids=[tok],
                finish_reason=status.finish_reason if status else None,
                stop_reason=req.stop_reason if status else None,
                new_logprobs=[lp] if lp is not None else None,
                new_prompt_logprobs=prompt_lps.get(rid),
                num_cached_tokens=max(req.num_cached_tokens, 0)))
            if status is not None:
                self._finish(req, status)
        return outputs
