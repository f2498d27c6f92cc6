"""Admission control of the async engine: the waiting-queue limits (``max_queued_requests``,
``max_queued_tokens``) and the account of prompt tokens they are checked against.

A request counts as queued from its acceptance until the core first schedules it (the core reports
that with each batch: ``EngineCoreOutputs.started``). A request the limits could never let
in is a bad request (InvalidRequestError, HTTP 400); one that does not fit now is EngineOverloaded
(HTTP 429: retry later).
"""
from __future__ import annotations

from asyncengine.config import EngineConfig
from asyncengine.core.request import Request
from asyncengine.engine.validation import RequestLimitError
from asyncengine.errors import EngineOverloaded
from asyncengine.sampling_params import SamplingParams


class Admission:
    def __init__(self, config: EngineConfig) -> None:
        self.max_queued_requests = config.max_queued_requests
        self.max_queued_tokens = config.max_queued_tokens
        self.queued_tokens: dict[str, int] = {}  # accepted, never scheduled: request id -> prompt tokens
        self.num_queued_tokens = 0

    def check_admissible(self, params: SamplingParams) -> None:
        """Refuse (400) a request whose samples could never all wait at once."""
        m = self.max_queued_requests
        if m is not None and params.n > m:
            raise RequestLimitError(f"n is {params.n}, but at most max_queued_requests={m} samples can ever "
                                    f"wait at once", param="n", limit="max_queued_requests")

    def check(self, req: Request, num_waiting: int) -> None:
        """Refuse ``req`` if it does not fit the queue now; ``num_waiting``: samples waiting (each
        sample of an n > 1 request counts, as the scheduler counts them)."""
        m, mt = self.max_queued_requests, self.max_queued_tokens
        if m is not None and num_waiting + req.sampling_params.n > m:
            raise EngineOverloaded(f"{num_waiting} requests are waiting (max_queued_requests={m}); retry later")
        if mt is not None and req.num_prompt_tokens > mt:
            raise RequestLimitError(
                f"the prompt is {req.num_prompt_tokens} tokens, but at most max_queued_tokens={mt} prompt "
                f"tokens can ever wait at once", param="prompt", limit="max_queued_tokens")
        if mt is not None and self.num_queued_tokens + req.num_prompt_tokens > mt:
            raise EngineOverloaded(f"{self.num_queued_tokens} prompt tokens are waiting "
                                   f"(max_queued_tokens={mt}); retry later")

    def add(self, request_id: str, num_prompt_tokens: int) -> None:
        self.queued_tokens[request_id] = num_prompt_tokens
        self.num_queued_tokens += num_prompt_tokens

    def remove(self, request_id: str) -> None:
        """Scheduled, finished or gone: no longer queued (a no-op for one that is not)."""
        self.num_queued_tokens -= self.queued_tokens.pop(request_id, 0)

    def clear(self) -> None:
        self.queued_tokens.clear()
        self.num_queued_tokens = 0
