"""Parallel samples (``n > 1``) in the scheduler: which samples each user request has, and the
samples held back until sample 0 has computed what they can share.

Kept apart from the scheduler so that ``schedule()`` reads as batching; the scheduler owns one.

``Scheduler.add_request`` fans a request out into ``n`` single-sample requests
(``Request.make_children``: ids ``"<id>#<i>"``, ``seed + i``). With prefix caching on, samples
1..n-1 are *held* (neither waiting nor running) until sample 0 has had its whole prompt scheduled;
then they queue at the front and their prefix lookup finds sample 0's full prompt blocks, which they
share by reference count: the prompt is prefilled once, and each other sample recomputes only the
prompt's last block (the partial one; or the last full one when the prompt ends exactly on a block
boundary, since the last prompt token is always recomputed to sample from). Hybrid models fork
sample 0's state and blocks instead (``fork``). With nothing to share the samples are independent
requests from the start (n prefills). Aborting the user's id aborts every sample still running.
"""
from __future__ import annotations

from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.request import Request


class ParallelSamples:
    def __init__(self, kv: KVCacheManager, waiting) -> None:
        self.kv = kv
        self.waiting = waiting  # the scheduler's queue: released samples go to its front
        self.parents: dict[str, set[str]] = {}  # user request id -> ids of its samples still in the engine
        self.held: list[Request] = []  # samples waiting for sample 0's prompt

    def add(self, req: Request, children: list[Request]) -> list[Request]:
        """Record ``req``'s samples and hold those that can share sample 0's work; returns the ones
        to queue now."""
        self.parents[req.request_id] = {c.request_id for c in children}
        leader = children[0]
        # hold the others only when they can share something: at least one full prompt block (through
        # the prefix cache, or, for hybrid models, a fork of sample 0's state and blocks: see fork)
        hold = (self.kv.enable_caching and (leader.num_prompt_tokens - 1) // self.kv.block_size > 0
                or self.kv.plan_fork(leader) > 0)
        now = []
        for c in children:
            if hold and c is not leader:
                c.hold_for = leader
                self.held.append(c)
            else:
                now.append(c)
        return now

    def release_ready(self) -> None:
        """Queue the held samples whose sample 0 has had its whole prompt scheduled (or is gone)."""
        ready = [c for c in self.held if c.hold_for.is_finished
                 or c.hold_for.num_computed_tokens >= c.hold_for.num_prompt_tokens]
        if not ready:
            return
        # at the front: they arrived with sample 0, before anything still waiting
        for c in reversed(ready):
            self.held.remove(c)
            c.hold_for = None
            self.waiting.push_front(c)

    def fork(self, leader: Request) -> None:
        """Hybrid models, ``n > 1``: sample 0 is scheduled on from its fork point (the last block
        boundary before its last prompt token; its chunks were cut there) in the step being built,
        so the runner copies its state, as it stands before this step, into each held sample's
        slot at the start of the step; the samples share its full prompt blocks and queue at the
        front with those tokens computed: each computes only the prompt's tail. A sample with no
        free slot is released to compute its whole prompt itself."""
        kids = [c for c in self.held if c.hold_for is leader]
        for c in reversed(kids):
            self.held.remove(c)
            c.hold_for = None
            if self.kv.fork(leader, c):
                c.num_computed_tokens = self.kv.fork_point(leader)
            self.waiting.push_front(c)
        self.kv.end_fork(leader)

    def unhold(self, req: Request) -> None:
        """A held sample finishes (aborted) before its release."""
        self.held.remove(req)
        req.hold_for = None

    def sample_finished(self, req: Request) -> None:
        """Forget a user request once its samples are all gone."""
        if req.parent_id is not None:
            kids = self.parents.get(req.parent_id)
            if kids is not None:
                kids.discard(req.request_id)
                if not kids:
                    del self.parents[req.parent_id]
