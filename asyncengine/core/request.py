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

import msgspec

from asyncengine.contracts.multimodal import MultiModalInput, block_extra
from asyncengine.lora_request import LoRARequest
from asyncengine.sampling_params import SamplingParams, resolve_unset

_SEED_MOD = 2**63


def child_request_id(parent_id: str, index: int) -> str:
    """The core id of sample ``index`` of a request with ``n > 1`` (``n == 1`` keeps its own id)."""
    return f"{parent_id}#{index}"


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
    lora_request: LoRARequest | None = None  # its adapter (its id is part of cache_salt: processor)
    # images: each one's encoder input and placeholder run (multimodal/; their hashes key the prefix cache)
    mm_inputs: list[MultiModalInput] | None = None

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
    # n > 1: the user request this sample belongs to (None for a plain request)
    parent_id: str | None = None
    # n > 1, samples 1..n-1: held out of the waiting queue until this request (sample 0) has had
    # its whole prompt scheduled, so that they find its prompt blocks in the prefix cache
    hold_for: "Request | None" = None
    # prompt logprobs: positions delivered so far (a recompute after preemption does not resend)
    num_prompt_logprobs: int = 0
    # P/D: where this request's prompt KV waits ({"source": "host:port"}, kv_connector/pd/)
    kv_transfer_params: dict[str, str] | None = None
    # KV connector: prompt tokens loaded from outside when last taken from the waiting queue (their
    # KV is the target's alone: a draft model computes them itself)
    num_external_tokens: int = 0

    def __post_init__(self) -> None:
        # The front ends fill unset sampling fields from the model's defaults (engine/processor.py);
        # a request made without one (tests, tools driving the core) gets the engine's table.
        self.sampling_params = resolve_unset(self.sampling_params)

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

    def make_children(self) -> list["Request"]:
        """The ``n`` single-sample core requests of a request with ``n > 1`` (vLLM's fan-out):
        ids ``child_request_id(id, i)``, ``seed + i`` when a seed is given (each sample its own
        stream), and prompt logprobs asked of sample 0 only (they are the same for all)."""
        sp = self.sampling_params
        children = []
        for i in range(sp.n):
            params = msgspec.structs.replace(
                sp, n=1, seed=None if sp.seed is None else (sp.seed + i) % _SEED_MOD,
                prompt_logprobs=sp.prompt_logprobs if i == 0 else None)
            children.append(Request(
                request_id=child_request_id(self.request_id, i), prompt_token_ids=self.prompt_token_ids,
                sampling_params=params, eos_token_ids=self.eos_token_ids, max_tokens=self.max_tokens,
                priority=self.priority, arrival_time=self.arrival_time, cache_salt=self.cache_salt,
                bad_words_token_ids=self.bad_words_token_ids, parent_id=self.request_id,
                kv_transfer_params=self.kv_transfer_params, lora_request=self.lora_request,
                mm_inputs=self.mm_inputs))
        return children

    def block_extra(self, start: int, stop: int) -> str | None:
        """What a block's hash adds to its tokens: the cache salt and the images it overlaps."""
        mm = block_extra(self.mm_inputs, start, stop)
        return f"{self.cache_salt or ''}{mm}" if mm else self.cache_salt

    def new_prompt_logprobs(self, chunk) -> list | None:
        """The part of a step's prompt logprobs ``(first position, entries)`` not delivered yet (a
        recompute after preemption computes them again)."""
        if chunk is None:
            return None
        start, entries = chunk
        skip = self.num_prompt_logprobs - start
        assert skip >= 0, f"{self.request_id}: prompt logprobs from {start}, expected {self.num_prompt_logprobs}"
        new = entries[skip:] if skip else entries
        self.num_prompt_logprobs = max(self.num_prompt_logprobs, start + len(entries))
        return new or None

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
