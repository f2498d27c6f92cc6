"""The engine for apps on trio (or any anyio backend): ``async for out in engine.generate(...)``
from a trio task, as on asyncio.

    from asyncengine import EngineConfig, SamplingParams
    from asyncengine.engine.anyio_bridge import AnyioEngine

    async def main():                      # run by trio.run(main) or anyio.run(main, backend="trio")
        async with AnyioEngine.from_config(EngineConfig(model="smollm2-135m-instruct")) as engine:
            async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
                print(out.text_delta, end="")

An :class:`~asyncengine.AsyncLLMEngine` needs an asyncio loop, and trio has none, so the engine
keeps its own asyncio loop in a thread ("asyncengine-loop"); the app's loop never runs engine code.
Only AsyncLLMEngine's public API is used (``from_config``, ``generate``, ``abort``, ``stats``,
``shutdown``), so the engine's internals can change under it.

How outputs cross: each request is a task on the engine's loop that iterates
``engine.generate`` and puts every output, tagged with the request, on one thread-safe queue
(a non-blocking put: the engine's loop never waits for the app). On the app's side one dispatcher
task per bridge takes whatever the queue holds in one worker-thread hop
(``anyio.to_thread.run_sync``) and hands each output to its request's anyio memory stream, which
``generate``'s iterator reads. One hop per batch of outputs, not per request: many concurrent
requests occupy one worker thread, not one each.

Leaving a stream early (``break`` then ``aclose()``, ``async with``, cancelling the consuming
task, or dropping the iterator) cancels the request's task on the engine's loop, which aborts the
request there and frees its KV blocks, as on asyncio.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import queue
import threading
from concurrent.futures import Future
from typing import Any

import anyio

_END = object()  # a request's task is done: close its stream
_STOP = object()  # the bridge is closing: the dispatcher returns


class _Failed:
    """What ended a request's task with an error, raised by its iterator after the outputs."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class BridgeStream:
    """The outputs of one request, on the app's loop: an async iterator of RequestOutputs.
    Errors the engine raises for the request (InvalidRequestError, EngineOverloaded,
    EngineDeadError...) surface at the first iteration after the outputs before them."""

    def __init__(self, bridge: "AnyioEngine", key: int, receive, future: Future) -> None:
        self._bridge = bridge
        self._key = key
        self._receive = receive
        self._future = future  # the request's task on the engine's loop
        self._done = False

    def __aiter__(self) -> "BridgeStream":
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._receive.receive()
        except anyio.EndOfStream:
            self._finish()
            raise StopAsyncIteration from None
        except BaseException:  # cancelled (or the stream closed under us): abort the request
            self._abandon()
            raise
        if isinstance(item, _Failed):
            self._finish()
            raise item.error
        return item

    def _finish(self) -> None:
        self._done = True
        self._bridge._forget(self._key)

    def _abandon(self) -> None:
        """Cancel the request's task on the engine's loop (non-blocking, thread-safe): its
        ``async for`` over ``engine.generate`` ends, which aborts the request."""
        if not self._done:
            self._future.cancel()
            self._finish()

    async def aclose(self) -> None:
        self._abandon()
        await self._receive.aclose()

    async def __aenter__(self) -> "BridgeStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __del__(self) -> None:  # a dropped iterator is aborted too (its stream closes when the task ends)
        if not self._done:
            self._future.cancel()


class AnyioEngine:
    """An AsyncLLMEngine driven from any anyio backend (trio included); see the module docstring.

    Use ``async with AnyioEngine.from_config(config) as engine:`` (or ``AnyioEngine(engine)`` for
    an AsyncLLMEngine built elsewhere and not yet used on any loop). The model loads on a worker
    thread inside ``__aenter__``, so the app's loop keeps running meanwhile."""

    def __init__(self, engine=None, *, config=None) -> None:
        if (engine is None) == (config is None):
            raise TypeError("give an AsyncLLMEngine or config=EngineConfig(...), not both")
        self._engine = engine
        self._config = config
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, Any] = {}  # key -> the memory stream's send side
        self._keys = itertools.count()
        self._task_group = None
        self._closed = False

    @classmethod
    def from_config(cls, config) -> "AnyioEngine":
        return cls(config=config)

    @property
    def engine(self):
        """The AsyncLLMEngine (its attributes may be read; its coroutines belong to its own loop)."""
        return self._engine

    # ------------------------------------------------------------------ life cycle

    async def __aenter__(self) -> "AnyioEngine":
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="asyncengine-loop", daemon=True)
        self._thread.start()
        try:
            if self._engine is None:
                from asyncengine.engine.async_engine import AsyncLLMEngine  # lazy: async_engine imports this module

                config = self._config
                self._engine = await anyio.to_thread.run_sync(AsyncLLMEngine.from_config, config)
            await self._call(self._engine.start())  # bind it to its loop
            self._task_group = anyio.create_task_group()
            await self._task_group.__aenter__()
            self._task_group.start_soon(self._dispatch)
        except BaseException:
            await self._stop_loop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self, drain: bool = False) -> None:
        """Shut the engine down (pending requests are aborted unless ``drain``) and stop its loop."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._engine is not None and self._loop is not None:
                with anyio.CancelScope(shield=True):
                    await self._call(self._engine.shutdown(drain=drain))
        finally:
            self._outbox.put(_STOP)
            if self._task_group is not None:
                self._task_group.cancel_scope.cancel()
                await self._task_group.__aexit__(None, None, None)
            for send in self._streams.values():
                send.close()
            self._streams.clear()
            with anyio.CancelScope(shield=True):
                await self._stop_loop()

    async def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        await anyio.to_thread.run_sync(thread.join)
        loop.close()

    async def _call(self, coro):
        """Run ``coro`` on the engine's loop and wait for it from the app's loop."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)
        except BaseException:
            future.cancel()
            raise

    # ------------------------------------------------------------------ requests

    def generate(self, prompt, sampling_params=None, request_id: str | None = None, *, priority: int = 0,
                 cache_salt: str | None = None, lora_request=None) -> BridgeStream:
        """Submit a request (AsyncLLMEngine.generate's arguments); returns its async iterator of
        RequestOutputs. Call it from a task on the app's loop, inside ``async with``."""
        if self._closed or self._loop is None:
            raise RuntimeError("AnyioEngine is not running: use it inside `async with AnyioEngine...`")
        key = next(self._keys)
        send, receive = anyio.create_memory_object_stream(math.inf)
        self._streams[key] = send
        future = asyncio.run_coroutine_threadsafe(
            self._produce(key, prompt, sampling_params, request_id, priority, cache_salt, lora_request), self._loop)
        return BridgeStream(self, key, receive, future)

    async def complete(self, prompt, sampling_params=None, request_id: str | None = None, **kw):
        """The final RequestOutput of a request (output_kind FINAL_ONLY gives one output)."""
        final = None
        async with self.generate(prompt, sampling_params, request_id, **kw) as stream:
            async for out in stream:
                final = out
        return final

    async def abort(self, request_id: str) -> None:
        await self._call(self._engine.abort(request_id))

    async def stats(self) -> dict:
        """AsyncLLMEngine.stats(), read on the engine's loop."""

        async def read():
            return self._engine.stats()

        return await self._call(read())

    async def _produce(self, key, prompt, params, request_id, priority, cache_salt, lora_request=None) -> None:
        """On the engine's loop: iterate the request and post its outputs. Cancelled when the app
        leaves the stream; the generator's close then aborts the request."""
        put = self._outbox.put
        try:
            stream = self._engine.generate(prompt, params, request_id, priority=priority, cache_salt=cache_salt,
                                           lora_request=lora_request)
            try:
                async for out in stream:
                    put((key, out))
            finally:
                await stream.aclose()
        except asyncio.CancelledError:
            put((key, _END))
            raise
        except BaseException as e:  # noqa: BLE001 - every error reaches the app's iterator
            put((key, _Failed(e)))
        put((key, _END))

    def _take(self) -> list:
        """On a worker thread: wait for the next outputs, then take all that are there."""
        items = [self._outbox.get()]
        while True:
            try:
                items.append(self._outbox.get_nowait())
            except queue.Empty:
                return items

    async def _dispatch(self) -> None:
        """On the app's loop: hand each output to its request's memory stream."""
        while True:
            items = await anyio.to_thread.run_sync(self._take, abandon_on_cancel=True)
            for item in items:
                if item is _STOP:
                    return
                key, value = item
                send = self._streams.get(key)
                if send is None:  # the app left this stream
                    continue
                if value is _END:
                    send.close()
                    self._streams.pop(key, None)
                else:
                    try:
                        send.send_nowait(value)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        self._streams.pop(key, None)

    def _forget(self, key: int) -> None:
        send = self._streams.pop(key, None)
        if send is not None:
            send.close()
