"""The scheduler's counters, read by the engine core's stats and metrics (engine_core/core.py)."""
from __future__ import annotations


class SchedulerStats:
    __slots__ = ("num_preemptions", "num_steps", "num_scheduled_tokens", "num_finished", "queue_time_s_total",
                 "num_started", "num_computed_prompt_tokens", "spec_num_drafts", "spec_num_draft_tokens",
                 "spec_num_accepted_tokens")

    def __init__(self) -> None:
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_scheduled_tokens = 0
        self.num_finished = 0
        self.queue_time_s_total = 0.0
        self.num_started = 0
        # prompt positions actually computed (prefix-cache hits excluded, recomputes included)
        self.num_computed_prompt_tokens = 0
        # speculative decoding: verify steps that had drafts, drafts proposed, drafts accepted
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
