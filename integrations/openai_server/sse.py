"""Server-sent events and client disconnects: a request's work runs as a task raced against the
client leaving, so a client that goes away cancels it at once (which aborts its engine requests),
even while no token is coming."""
from __future__ import annotations

import asyncio
import contextlib

import msgspec
from starlette.requests import Request


def sse_event(obj) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


async def _wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, coro):
    """Run ``coro``; if the client goes away first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class SSEResponse:
    """text/event-stream from an async iterator of ready-made event bytes. The iterator runs as its
    own task, raced against the client's disconnect: a client that leaves cancels it at once (even
    while no token is coming), which aborts its engine requests."""

    def __init__(self, events) -> None:
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})

        async def pump() -> None:
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        task = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                with contextlib.suppress(OSError):  # the client left during the last send
                    task.result()
        finally:
            for t in (task, watcher):
                t.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)
            await self.events.aclose()
