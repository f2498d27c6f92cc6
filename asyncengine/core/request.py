"""A request's state inside the engine core, and its state machine.

WAITING --schedule--> RUNNING --preempt--> PREEMPTED (waits again, recomputes) --schedule--> RUNNING
   any --finish--> FINISHED_STOPPED | FINISHED_LENGTH | FINISHED_ABORTED

``num_computed_tokens`` is advanced when a step is *scheduled* (not when it returns), so the
scheduler can plan step N+1 while step N runs; ``num_output_placeholders`` counts the tokens that
scheduled-but-unfinished steps will produce.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from asyncengine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = 16  # resolved: sampling_params.max_tokens or what fits in max_model_len
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    bad_words_token_ids: list[list[int]] | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache, set at first schedule
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    # chained hashes of this request's full blocks; extended as tokens arrive (prefix caching)
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens whose ids are known (prompt + outputs returned so far)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def token_id_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    def check_stop(self, token_id: int) -> RequestStatus | None:
        """The engine-side stop rules (EOS, stop token ids, max_tokens). Stop *strings* are the
        front end's job: they need text."""
        sp = self.sampling_params
        n_out = len(self.output_token_ids)
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token_id in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and token_id in sp.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
