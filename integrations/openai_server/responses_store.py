"""The Responses API's memory: finished responses kept for ``GET /v1/responses/{id}`` and for a later
turn's ``previous_response_id``, bounded in number (the oldest goes first) and in age (TTL).

Each entry holds the whole conversation up to and including its output as chat messages, so a
turn that continues it needs one lookup, not a walk up the chain. In memory only: a restart
forgets every response (clients then get a 404 naming the id).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_SIZE = 1024
DEFAULT_TTL_S = 3600.0


@dataclass(slots=True)
class StoredResponse:
    response: dict  # the Response object as it was answered
    messages: list[dict]  # the conversation, its output last (chat messages, without instructions)
    expires: float


class ResponseStore:
    """At most ``max_entries`` responses, each for ``ttl_s`` seconds (``max_entries=0``: none)."""

    def __init__(self, max_entries: int = DEFAULT_SIZE, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0 or not ttl_s > 0:
            raise ValueError(f"the responses store needs a size >= 0 and a TTL > 0, got {max_entries}, {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, response: dict, messages: list[dict]) -> None:
        if self.max_entries == 0:
            return
        self._expire()
        self._entries[response_id] = StoredResponse(response, messages, self.clock() + self.ttl_s)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        """Drop expired entries (insertion order is expiry order: one TTL for all)."""
        now = self.clock()
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.expires > now:
                return
            self._entries.popitem(last=False)
