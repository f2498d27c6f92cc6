"""Pipeline parallelism, scheduler side: which requests are in a batch that has not come back, and
which of their output tokens the stages have been sent.

Kept apart from the scheduler so that ``schedule()`` reads as batching; the scheduler owns one and
fills it only with ``pipeline_parallel=True``. Batches in flight are disjoint (a request in one is
not scheduled again until it is back), and the stages that do not sample learn each request's
tokens from the step that carries it next (``CachedRequestData.new_token_ids``).
"""
from __future__ import annotations

from asyncengine.core.request import Request


class PipelineInFlight:
    def __init__(self) -> None:
        self._in_flight: set[str] = set()  # requests in a batch not yet updated
        self._tokens_sent: dict[str, int] = {}  # request id -> output tokens the stages were sent

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._in_flight

    def send(self, req: Request) -> list[int]:
        """``req`` goes into a batch: returns its output tokens the stages have not been sent yet."""
        rid = req.request_id
        self._in_flight.add(rid)
        new = req.output_token_ids[self._tokens_sent.get(rid, 0):]
        self._tokens_sent[rid] = len(req.output_token_ids)
        return new

    def returned(self, request_ids) -> None:
        """A batch came back: its requests may be scheduled again."""
        if self._in_flight:
            self._in_flight.difference_update(request_ids)

    def forget(self, request_id: str) -> None:
        self._tokens_sent.pop(request_id, None)
