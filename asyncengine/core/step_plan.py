"""The step the scheduler is building: what it has scheduled so far and the token budget left.
``Scheduler.schedule`` fills one in its sub-steps (running requests, then waiting ones) and turns it
into the ``SchedulerOutput``; preemption takes a request back out of it."""
from __future__ import annotations

from dataclasses import dataclass, field

from asyncengine.core.request import Request


@dataclass
class StepPlan:
    budget: int  # tokens this step may still schedule
    num_scheduled: dict[str, int] = field(default_factory=dict)  # req_id -> tokens this step
    new_blocks: dict[str, list[int]] = field(default_factory=dict)  # req_id -> blocks it just got
    new_reqs: list[Request] = field(default_factory=list)  # admitted from waiting this step
    spec: dict[str, int] = field(default_factory=dict)  # req_id -> draft slots
    preempted: int = 0  # requests preempted to make room (nothing is admitted then)

    def unschedule(self, victim: Request) -> int:
        """Take a request out of the step; returns the budget it gave back."""
        self.new_blocks.pop(victim.request_id, None)
        self.spec.pop(victim.request_id, None)
        if victim in self.new_reqs:
            self.new_reqs.remove(victim)
        return self.num_scheduled.pop(victim.request_id, 0)
