"""The scheduler: continuous (iteration-level) batching under a token budget.

No prefill and decode phases: each request's ``num_computed_tokens`` catches up with its tokens;
a step gives running requests their next tokens first (a decode one, a long prompt a chunk of the
budget left), then admits waiting ones while budget, slots and KV blocks last. Out of blocks, the
policy's victim is preempted by recompute (blocks freed, it waits at the front; no admission then).

Async scheduling: ``num_computed_tokens`` advances when a step is scheduled and each sampling step
adds an output placeholder: step N+1 is planned before step N's tokens are known.

Speculative decoding (``num_spec_tokens`` = k > 0): a request whose next step is a single decode
token is scheduled 1 + k tokens (budget and KV slots); the runner fills the k extra slots with draft
tokens and verifies them in the same forward pass, and returns the m (1..k+1) tokens it accepted.
Counts are *optimistic* while a step is in flight (all k drafts assumed accepted: k + 1
placeholders, ``num_computed_tokens`` advanced by 1 + k), so KV blocks always cover what the runner
may write, and ``update`` takes back the k + 1 - m that were not accepted. The runner keeps each
request's true position; a rejected draft's KV slot is overwritten by the next step.

Pipeline parallelism (``pipeline_parallel=True``): batches in flight are disjoint: a request in a
batch that has not come back is not scheduled again, so the core keeps one batch per stage in flight
with no placeholders; each request's step carries the tokens sampled since its last one
(``CachedRequestData.new_token_ids``) for the stages that do not sample (core/pipeline_in_flight.py).

Parallel samples (``n > 1``): ``add_request`` fans the request out into ``n`` single-sample
requests; those that can share sample 0's prompt wait for it (core/parallel_samples.py). KV
connector (``kv_connector/base.py``; None = none): a waiting request's prompt tokens past its
prefix-cache hit may come from outside, and a finished request's blocks may be held for a transfer
out (core/kv_transfer_state.py). LoRA: at most ``max_loras`` adapters run (core/lora_admission.py).
Images: a chunk stops before an image whose encoding does not fit the step (core/encoder_budget.py).
"""
from __future__ import annotations

import time

from asyncengine.core.encoder_budget import EncoderBudget
from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.kv_transfer_state import KVTransferState
from asyncengine.core.lora_admission import put_back, too_many_loras
from asyncengine.config.sub_configs import LoRAConfig, SchedulerConfig
from asyncengine.core.parallel_samples import ParallelSamples
from asyncengine.core.pipeline_in_flight import PipelineInFlight
from asyncengine.core.request import Request, RequestStatus
from asyncengine.core.request_queue import make_queue
from asyncengine.contracts.sched_output import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                                           NewRequestData, SchedulerOutput)
from asyncengine.core.sched_stats import SchedulerStats
from asyncengine.core.step_plan import StepPlan


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig, *, max_model_len: int, num_spec_tokens: int = 0,
                 kv_connector=None, pipeline_parallel: bool = False, lora: LoRAConfig | None = None) -> None:
        """The scheduler's view; ``max_model_len`` as the core resolved it; ``lora``: None = no adapter bound."""
        self.kv, self.connector = kv, kv_connector
        self.pipeline_parallel = pipeline_parallel
        self.pp_in_flight = PipelineInFlight()  # pipeline parallel: requests in a batch not yet back
        self.num_spec_tokens = num_spec_tokens
        self.max_num_seqs, self.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy, self.enable_chunked_prefill = config.policy, config.enable_chunked_prefill
        self.max_loras = lora.max_loras if lora is not None and lora.enable_lora else None  # adapters at once
        self.waiting = make_queue(config.policy, config.priority_aging_s)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # to tell the runner at the next schedule()
        self.samples = ParallelSamples(kv, self.waiting)  # n > 1: samples of each request, held ones
        self.kv_transfer = KVTransferState(kv, kv_connector, self.waiting)  # loads in, leases out
        self.stats = SchedulerStats()
        self.encoder = EncoderBudget(config.max_num_encoder_input_tokens or config.max_num_batched_tokens,
                                     self.running, chunked=config.enable_chunked_prefill)

    # ------------------------------------------------------------------ requests in / out

    def add_request(self, req: Request) -> None:
        rid = req.request_id
        if rid in self.requests or rid in self.samples.parents or rid in self.kv_transfer.leases:
            raise ValueError(f"request id {rid!r} is already in the engine")
        children = [req] if req.sampling_params.n == 1 else req.make_children()
        for c in children:
            if c.request_id in self.requests:
                raise ValueError(f"request id {c.request_id!r} is already in the engine")
        queue_now = children if req.sampling_params.n == 1 else self.samples.add(req, children)
        for c in children:
            self.requests[c.request_id] = c
            c.status = RequestStatus.WAITING
        for c in queue_now:
            self.waiting.add(c)

    def abort_requests(self, request_ids) -> list[str]:
        """Abort whatever of ``request_ids`` is still here (a user id of an ``n > 1`` request
        aborts all its samples); returns the core ids actually aborted."""
        done = []
        for rid in request_ids:
            kids = self.samples.parents.get(rid)
            for cid in (sorted(kids) if kids else (rid,)):
                req = self.requests.get(cid)
                if req is None:
                    continue
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                done.append(cid)
        return done

    def has_unfinished(self) -> bool:
        """Requests in the engine, or KV transfers still to hear back from (a read for a request
        aborted meanwhile still holds host slots until the worker reports it)."""
        return bool(self.requests) or self.kv_transfer.has_pending()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.samples.held) + len(self.kv_transfer.waiting_for_kv)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.hold_for is not None:
            self.samples.unhold(req)
        elif self.kv_transfer.waiting_for_kv.pop(req.request_id, None) is not None:
            pass
        elif not req.status.finished:
            self.waiting.remove(req)
        req.status = status
        self.kv_transfer.request_finished(req)  # its blocks freed, or held for a transfer out
        del self.requests[req.request_id]
        self.samples.sample_finished(req)
        self._finished_ids.append(req.request_id)
        self.pp_in_flight.forget(req.request_id)
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

    def _preempt_lower(self, req: Request, plan: StepPlan) -> bool:
        """Priority policy: preempt the worst running request if waiting ``req`` strictly
        outranks it (both ranks aged). Returns whether anything was preempted."""
        if not self.running:
            return False
        victim = self.waiting.pick_victim(self.running)
        if not self.waiting.outranks(req, victim):
            return False
        # a victim already scheduled in this step registered the blocks its chunk fills as cached;
        # they must leave the cache, unless a request admitted in this step already hit them
        if victim.request_id in plan.num_scheduled and not self.kv.uncache_unscheduled(victim):
            return False
        plan.unschedule(victim)
        self._preempt(victim)
        return True

    def _tokens_to_schedule(self, req: Request) -> int:
        """Tokens the request could compute now: the rest of its prompt/recompute, or one decode."""
        if self.pipeline_parallel and req.request_id in self.pp_in_flight:
            return 0  # disjoint batches: its last step has not come back
        n = req.num_tokens_with_placeholders - req.num_computed_tokens
        if n > 0 and req.num_computed_tokens + n >= req.num_tokens_with_placeholders:
            # this step would sample: only if another output token is still wanted
            if len(req.output_token_ids) + req.num_output_placeholders >= req.max_tokens:
                return 0
        return n

    def _num_spec(self, req: Request, budget: int) -> int:
        """Draft slots for a request about to be scheduled one token that samples (0: none)."""
        k = min(self.num_spec_tokens, budget - 1,
                req.max_tokens - len(req.output_token_ids) - req.num_output_placeholders - 1)
        if k <= 0 or req.sampling_params.prompt_logprobs is not None:
            return 0
        return k

    def schedule(self) -> SchedulerOutput:
        """One step in three sub-steps: the running requests' next tokens, in order (preempting for
        KV blocks), then waiting requests while budget, sequence slots and blocks last (none if
        this step preempted), then the message, with the computed counts advanced."""
        if self.samples.held:
            self.samples.release_ready()
        if self.kv_transfer.leases:
            self.kv_transfer.expire_leases()
        plan = StepPlan(budget=self.max_num_batched_tokens)
        self.encoder.begin_step()
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        return self._build_output(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        num_scheduled, new_blocks, budget = plan.num_scheduled, plan.new_blocks, plan.budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            t = self._tokens_to_schedule(req)
            n = self.encoder.fit(req, req.num_computed_tokens, self.kv.cut_chunk(req, min(t, budget)))
            if n <= 0:
                i += 1
                continue
            k = self._num_spec(req, budget) if t == 1 and self.num_spec_tokens else 0
            n += k
            while True:
                blocks = self.kv.allocate_slots(req, n)
                if blocks is not None:
                    break
                victim = self.waiting.pick_victim(self.running)
                vi = self.running.index(victim)
                if victim.request_id in num_scheduled:  # nothing hit its fresh blocks yet this step
                    uncached = self.kv.uncache_unscheduled(victim)
                    assert uncached
                budget += plan.unschedule(victim)
                self._preempt(victim)
                plan.preempted += 1
                if vi < i:
                    i -= 1
                if victim is req:
                    break
            if blocks is None:
                continue  # req itself was preempted; running[i] is now the next request
            num_scheduled[req.request_id] = n
            new_blocks[req.request_id] = [b.block_id for b in blocks]
            if k:
                plan.spec[req.request_id] = k
            budget -= n
            i += 1
        plan.budget = budget

    def _schedule_waiting(self, plan: StepPlan) -> None:
        num_scheduled, new_reqs, budget = plan.num_scheduled, plan.new_reqs, plan.budget
        priority, skipped = self.policy == "priority", []  # skipped: requests whose adapter must wait
        while len(self.waiting) and budget > 0:
            req = self.waiting.peek()
            if req.num_output_placeholders or req.request_id in self.pp_in_flight:
                break  # a step of it is still in flight from before its preemption
            if too_many_loras(req, self.running, self.max_loras):
                skipped.append(self.waiting.pop())  # one adapter too many: it waits, the requests behind it need not
                continue
            if len(self.running) >= self.max_num_seqs:
                if not (priority and self._preempt_lower(req, plan)):
                    break
                budget = self.max_num_batched_tokens - sum(num_scheduled.values())
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            num_ext = 0
            if self.connector is not None:
                num_ext, load_async = self.connector.get_num_new_matched_tokens(req, num_hit)
                if load_async:
                    self.waiting.pop()
                    self.kv_transfer.waiting_for_kv[req.request_id] = req
                    continue
            n = req.num_tokens - num_hit - num_ext
            if n > budget:
                if not self.enable_chunked_prefill:
                    break
                n = budget
            n = self.encoder.fit(req, num_hit + num_ext, self.kv.cut_chunk(req, n))
            if n <= 0:
                break  # its next image waits for a step with encoder budget left
            blocks = self.kv.allocate_slots(req, n + num_ext, hit_blocks)
            if blocks is None:
                # priority policy: a better waiting request may take a worse one's blocks
                if priority and self._preempt_lower(req, plan):
                    budget = self.max_num_batched_tokens - sum(num_scheduled.values())
                    continue
                break
            self.waiting.pop()
            if self.kv.enable_caching:
                self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            req.status = RequestStatus.RUNNING
            if self.connector is not None:
                self.connector.update_state_after_alloc(req, self.kv.req_to_blocks[req.request_id],
                                                        num_hit, num_ext)
                num_hit, req.num_external_tokens = num_hit + num_ext, num_ext
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
        put_back(self.waiting, skipped)
        plan.budget = budget

    def _build_output(self, plan: StepPlan) -> SchedulerOutput:
        """The message, and the computed counts advanced (async scheduling)."""
        num_scheduled, new_blocks = plan.num_scheduled, plan.new_blocks
        new_ids = {r.request_id for r in plan.new_reqs}
        new_data: list[NewRequestData] = []
        cached_data: list[CachedRequestData] = []
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            new_tokens = self.pp_in_flight.send(req) if self.pipeline_parallel else []
            if rid in new_ids:
                new_data.append(NewRequestData(
                    req_id=rid, prompt_token_ids=req.prompt_token_ids, sampling_params=req.sampling_params,
                    output_token_ids=list(req.output_token_ids), num_computed_tokens=req.num_computed_tokens,
                    block_ids=self.kv.block_ids(rid), group_block_ids=self.kv.group_block_ids(rid),
                    eos_token_ids=sorted(req.eos_token_ids), bad_words_token_ids=req.bad_words_token_ids,
                    num_external_tokens=req.num_external_tokens, state_slot=self.kv.state_slot(rid),
                    lora_request=req.lora_request, mm_inputs=req.mm_inputs))
            else:
                cached_data.append(CachedRequestData(
                    req_id=rid, new_block_ids=new_blocks[rid], num_computed_tokens=req.num_computed_tokens,
                    new_group_block_ids=self.kv.take_new_group_block_ids(rid), new_token_ids=new_tokens))
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.stats.num_computed_prompt_tokens += min(n, req.num_prompt_tokens - req.num_computed_tokens)
            if self.samples.held and self.kv.at_fork_point(req):
                self.samples.fork(req)
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens_with_placeholders:
                req.num_output_placeholders += 1 + plan.spec.get(rid, 0)
        total = sum(num_scheduled.values())
        meta = self.connector.build_meta(num_scheduled, self.requests) if self.connector is not None else None
        finished, self._finished_ids = self._finished_ids, []
        self.stats.num_steps += total > 0
        self.stats.num_scheduled_tokens += total
        return SchedulerOutput(new_requests=new_data, cached_requests=cached_data,
                               num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=total,
                               finished_req_ids=finished, num_preempted=plan.preempted,
                               num_spec_tokens=plan.spec, kv_connector_metadata=meta,
                               state_copies=self.kv.take_state_copies())

    # ------------------------------------------------------------------ results back

    def kv_connector_stats(self) -> dict:
        """The connector's counters, and the blocks held for transfers (empty without a connector)."""
        return self.kv_transfer.stats()

    def update(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Fold a finished step's sampled tokens into request states; emit per-request outputs
        (also for chunks that sampled nothing but carry prompt logprobs)."""
        outputs: list[EngineCoreOutput] = []
        if self.connector is not None:  # (the scheduler side may have news without the worker's)
            self.kv_transfer.step_done(out.kv_connector_output)
        self.pp_in_flight.returned(sched.num_scheduled_tokens)
        logprobs = out.logprobs
        prompt_lps = out.prompt_logprobs or {}
        if prompt_lps:
            sampled = set(out.req_ids)
            for rid, chunk in prompt_lps.items():
                req = self.requests.get(rid)
                if rid in sampled or req is None:
                    continue
                plp = req.new_prompt_logprobs(chunk)
                if plp:
                    outputs.append(EngineCoreOutput(req_id=rid, new_token_ids=[], new_prompt_logprobs=plp,
                                                    num_cached_tokens=max(req.num_cached_tokens, 0)))
        spec = sched.num_spec_tokens
        drafts = out.num_draft_tokens
        st = self.stats
        for j, (rid, toks) in enumerate(zip(out.req_ids, out.sampled_token_ids)):
            req = self.requests.get(rid)
            if req is None:
                continue  # finished or aborted while this step was in flight
            k = spec.get(rid, 0) if spec else 0
            req.num_output_placeholders -= 1 + k  # what schedule() assumed this step would give
            if k:
                # take back the optimistic count of drafts that were not accepted (a request
                # preempted meanwhile restarts from 0 anyway)
                if req.status == RequestStatus.RUNNING:
                    req.num_computed_tokens -= k + 1 - len(toks)
            new_ids: list[int] = []
            status = None
            for tok in toks:  # only accepted tokens reach stop checks; none past a stop
                req.output_token_ids.append(tok)
                new_ids.append(tok)
                status = req.check_stop(tok)
                if status is not None:
                    break
            if drafts is not None and drafts[j]:
                st.spec_num_drafts += 1
                st.spec_num_draft_tokens += drafts[j]
                st.spec_num_accepted_tokens += min(drafts[j], len(new_ids) - 1)
            outputs.append(EngineCoreOutput(
                req_id=rid, new_token_ids=new_ids,
                finish_reason=status.finish_reason if status else None,
                stop_reason=req.stop_reason if status else None,
                new_logprobs=logprobs[j][:len(new_ids)] if logprobs is not None and logprobs[j] is not None else None,
                new_prompt_logprobs=req.new_prompt_logprobs(prompt_lps.get(rid)) if prompt_lps else None,
                num_cached_tokens=max(req.num_cached_tokens, 0), num_preemptions=req.num_preemptions,
                pooled=out.pooled.get(rid) if out.pooled else None))
            if status is not None:
                self._finish(req, status)
        return outputs
