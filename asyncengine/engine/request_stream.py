"""Per-request output slot and the async iterator a caller consumes.

The slot holds at most one pending output: when the consumer is slower than the engine, new
deltas are merged into it instead of queueing, so a slow client never blocks the engine and never
grows memory without bound (vLLM's collector design).
"""
from __future__ import annotations

import asyncio
from typing import Callable

from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import OutputKind


def merge_outputs(old: RequestOutput, new: RequestOutput, kind: OutputKind) -> RequestOutput:
    """Fold ``new`` into a not-yet-consumed ``old``: deltas concatenate, cumulative fields take
    the newer value."""
    new.text_delta = old.text_delta + new.text_delta
    new.token_ids_delta = old.token_ids_delta + new.token_ids_delta
    if new.prompt_logprobs is None:  # DELTA shows them only once
        new.prompt_logprobs = old.prompt_logprobs
    if kind == OutputKind.DELTA:
        by_index = {c.index: c for c in old.outputs}
        merged = []
        for c in new.outputs:
            o = by_index.get(c.index)
            if o is not None:
                c = CompletionOutput(
                    index=c.index, text=o.text + c.text, token_ids=o.token_ids + c.token_ids,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    logprobs=(o.logprobs or []) + (c.logprobs or []) if (o.logprobs or c.logprobs) else None,
                    cumulative_logprob=c.cumulative_logprob, weights_versions=o.weights_versions + c.weights_versions)
            merged.append(c)
        seen = {c.index for c in merged}
        merged.extend(c for c in old.outputs if c.index not in seen)
        merged.sort(key=lambda c: c.index)
        new.outputs = merged
    return new


class RequestSlot:
    """Written by the engine's loop, read by one consumer, both on the same event loop."""

    __slots__ = ("request_id", "kind", "_pending", "_event", "_error", "finished")

    def __init__(self, request_id: str, kind: OutputKind) -> None:
        self.request_id = request_id
        self.kind = kind
        self._pending: RequestOutput | None = None
        self._event = asyncio.Event()
        self._error: BaseException | None = None
        self.finished = False

    def put(self, out: RequestOutput) -> None:
        if self._pending is not None:
            out = merge_outputs(self._pending, out, self.kind)
        self._pending = out
        if out.finished:
            self.finished = True
        self._event.set()

    def put_error(self, exc: BaseException) -> None:
        self._error = exc
        self.finished = True
        self._event.set()

    async def get(self) -> RequestOutput:
        while self._pending is None:
            if self._error is not None:
                raise self._error
            self._event.clear()
            await self._event.wait()
        out, self._pending = self._pending, None
        return out


class RequestStream:
    """``async for out in engine.generate(...)``. Leaving early in any way — break, aclose(),
    cancelling the consuming task, or dropping the iterator — aborts the request in the engine."""

    def __init__(self, slot: RequestSlot, on_abandon: Callable[[RequestSlot], None]) -> None:
        self._slot = slot
        self._on_abandon = on_abandon
        self._done = False

    @property
    def request_id(self) -> str:
        return self._slot.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._slot.get()
        except asyncio.CancelledError:
            self._abandon()
            raise
        except BaseException:
            self._done = True
            raise
        if out.finished:
            self._done = True
        return out

    def _abandon(self) -> None:
        if not self._done:
            self._done = True
            self._on_abandon(self._slot)  # the slot, not its id: the id may belong to a newer request

    async def aclose(self) -> None:
        self._abandon()

    def close(self) -> None:
        """``aclose()`` for code that cannot await (a wrapping stream's cleanup)."""
        self._abandon()

    def __del__(self) -> None:
        try:
            self._abandon()
        except Exception:
            pass
