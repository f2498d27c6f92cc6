"""One AsyncLLMEngine, used from sync code and from any event loop (the framework adapters' seam).

An ``AsyncLLMEngine`` lives on one event loop. Framework adapters (LangChain, LlamaIndex) are called
from sync code (``invoke``), from the app's loop (``ainvoke``) and from loops that come and go
(a test runner's loop per test). :class:`EngineBridge` hides that: called on the engine's own loop
it iterates ``engine.generate`` directly (no thread hop); from anywhere else it runs the request on
the engine's loop and hands the outputs over. An engine not started yet is started on a private
background loop thread (one per process, made on first need). Engines the adapters build from a
model name are shared per (model, options) (:func:`shared_engine`).

Leaving a stream early in any way (break, ``aclose``, cancelling the consuming task, closing a
sync generator) aborts the request in the engine, as leaving ``engine.generate`` does: its KV blocks
are freed.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from asyncengine.outputs import RequestOutput

_END = object()
_host_lock = threading.Lock()
_host_loop: asyncio.AbstractEventLoop | None = None


def host_loop() -> asyncio.AbstractEventLoop:
    """The process's background loop for engines nobody else started (a daemon thread)."""
    global _host_loop
    with _host_lock:
        if _host_loop is None or _host_loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="asyncengine-host-loop", daemon=True).start()
            _host_loop = loop
        return _host_loop


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _left(deadline: float | None) -> float | None:
    """Seconds to ``deadline`` (None: no limit); a deadline already passed leaves 0."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class EngineBridge:
    """``stream`` / ``astream`` over one engine, from any thread or loop."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._start_lock = threading.Lock()

    def engine_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the engine runs on, starting it on the host loop if it runs nowhere."""
        loop = self.engine.loop
        if loop is not None:
            return loop
        with self._start_lock:
            loop = self.engine.loop
            if loop is None:
                loop = host_loop()
                asyncio.run_coroutine_threadsafe(self.engine.start(), loop).result()
        return loop

    def lora(self, lora):
        """A LoRARequest, None (the base model) or the name of an adapter registered on the engine
        (``add_lora``; the server's ``--lora-modules``) -> the LoRARequest to run under."""
        if lora is None or not isinstance(lora, str):
            return lora
        found = self.engine.get_lora(lora)
        if found is None:
            raise ValueError(f"no LoRA adapter named {lora!r} is loaded on this engine (engine.add_lora)")
        return found

    async def _produce(self, prompt, params, request_id, put, lora_request=None) -> None:
        """On the engine's loop: the request's outputs handed to ``put``, then _END (or the error).
        Cancelled: the engine stream is abandoned, which aborts the request."""
        try:
            async for out in self.engine.generate(prompt, params, request_id=request_id, lora_request=lora_request):
                put(out)
        except BaseException as e:  # noqa: BLE001 - every way out reaches the consumer
            put(e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        put(_END)

    async def astream(self, prompt, params, request_id: str | None = None, *, deadline: float | None = None,
                      lora_request=None) -> AsyncIterator[RequestOutput]:
        """The request's outputs, on the caller's loop. ``deadline`` (``time.monotonic()``): past
        it the request is aborted and TimeoutError raised. ``lora_request``: see :meth:`lora`."""
        lora_request = self.lora(lora_request)
        here = asyncio.get_running_loop()
        loop = self.engine_loop()
        if loop is here:  # the engine's own loop: no hop, cancellation reaches the stream directly
            stream = self.engine.generate(prompt, params, request_id=request_id, lora_request=lora_request)
            try:
                while True:
                    try:
                        out = await asyncio.wait_for(anext(stream), _left(deadline))
                    except StopAsyncIteration:
                        return
                    yield out
            finally:
                await stream.aclose()
        q: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                here.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                pass

        fut = asyncio.run_coroutine_threadsafe(self._produce(prompt, params, request_id, put, lora_request), loop)
        try:
            while True:
                item = await asyncio.wait_for(q.get(), _left(deadline))
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):  # cancelled on the engine's side
                        raise RuntimeError("the engine request was cancelled")
                    raise item
                yield item
        finally:
            if not fut.done():
                fut.cancel()  # cancels the producer on the engine's loop: the request is aborted

    def stream(self, prompt, params, request_id: str | None = None, *, deadline: float | None = None,
               lora_request=None) -> Iterator[RequestOutput]:
        """The request's outputs, blocking (not on the engine's loop); ``deadline`` and
        ``lora_request`` as in astream."""
        lora_request = self.lora(lora_request)
        loop = self.engine_loop()
        if _running_loop() is loop:
            raise RuntimeError("a sync call on the engine's own event loop would block it: use the async "
                               "API (ainvoke / astream) there")
        q: queue.SimpleQueue = queue.SimpleQueue()
        fut = asyncio.run_coroutine_threadsafe(self._produce(prompt, params, request_id, q.put, lora_request), loop)
        try:
            while True:
                try:
                    item = q.get(timeout=_left(deadline))
                except queue.Empty:
                    raise TimeoutError("the request ran past its timeout and was aborted") from None
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        raise RuntimeError("the engine request was cancelled")
                    raise item
                yield item
        finally:
            if not fut.done():
                fut.cancel()

    def call(self, coro_fn, *args):
        """Run ``coro_fn(engine, *args)`` on the engine's loop and wait (sync)."""
        loop = self.engine_loop()
        if _running_loop() is loop:
            raise RuntimeError("a sync call on the engine's own event loop would block it")
        return asyncio.run_coroutine_threadsafe(coro_fn(self.engine, *args), loop).result()

    async def acall(self, coro_fn, *args):
        """Run ``coro_fn(engine, *args)`` on the engine's loop from any loop."""
        loop = self.engine_loop()
        if loop is asyncio.get_running_loop():
            return await coro_fn(self.engine, *args)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro_fn(self.engine, *args), loop))


async def _embed(engine, texts: list, pooling, normalize, dimensions) -> list[list[float]]:
    return await engine.embed(texts, pooling=pooling, normalize=normalize, dimensions=dimensions)


def embed_texts(bridge: EngineBridge, texts, pooling=None, normalize=True, dimensions=None) -> list[list[float]]:
    """``engine.embed`` from sync code (the embedding adapters' seam); no texts, no request."""
    texts = list(texts)
    return bridge.call(_embed, texts, pooling, normalize, dimensions) if texts else []


async def aembed_texts(bridge: EngineBridge, texts, pooling=None, normalize=True,
                       dimensions=None) -> list[list[float]]:
    """``engine.embed`` from any event loop (the engine's own or another)."""
    texts = list(texts)
    return await bridge.acall(_embed, texts, pooling, normalize, dimensions) if texts else []


async def _rerank(engine, query: str, documents: list[str]) -> list[float]:
    return await engine.rerank(query, documents)


def rerank_texts(bridge: EngineBridge, query: str, documents) -> list[float]:
    """``engine.rerank`` from sync code (the reranker adapters' seam); no documents, no request."""
    documents = list(documents)
    return bridge.call(_rerank, query, documents) if documents else []


async def arerank_texts(bridge: EngineBridge, query: str, documents) -> list[float]:
    """``engine.rerank`` from any event loop (the engine's own or another)."""
    documents = list(documents)
    return await bridge.acall(_rerank, query, documents) if documents else []


_engines: dict[tuple, Any] = {}
_engines_lock = threading.Lock()


def model_from_engine(values: Any, field: str) -> Any:
    """An adapter's "before" validator: a given engine names the model (``field``: the adapter's
    model field) unless the caller did."""
    if isinstance(values, dict) and values.get("engine") is not None and not (
            values.get("model") or values.get("model_name")):
        values = {**values, field: str(values["engine"].config.model)}
    return values


def bridge_of(adapter, model: str) -> EngineBridge:
    """A framework adapter's bridge (LangChain, LlamaIndex: chat and embeddings), made on first use:
    to the app's own engine (``adapter.engine``), or to the one shared per model and options."""
    if adapter._bridge is None:
        engine = adapter.engine if adapter.engine is not None else shared_engine(model, adapter.engine_options)
        adapter._bridge = EngineBridge(engine)
    return adapter._bridge


def shared_engine(model: str, engine_options: dict | None = None):
    """The process's AsyncLLMEngine for (model, options), built on first use and then shared."""
    from asyncengine.config import EngineConfig  # lazy: the engine and its model code load only when serving starts
    from asyncengine.engine.async_engine import AsyncLLMEngine  # lazy: the engine and its model code load only when serving starts

    opts = dict(engine_options or {})
    key = (model, json.dumps(opts, sort_keys=True, default=repr))
    with _engines_lock:
        eng = _engines.get(key)
        if eng is None or eng.errored or eng.is_closing:
            eng = _engines[key] = AsyncLLMEngine.from_config(EngineConfig(model=model, **opts))
        return eng


def close_shared_engines() -> None:
    """Shut down the engines :func:`shared_engine` built (they are rebuilt if used again)."""
    with _engines_lock:
        engines, _ = list(_engines.values()), _engines.clear()
    for eng in engines:
        EngineBridge(eng).call(lambda e: e.shutdown(drain=False))


__all__ = ["EngineBridge", "bridge_of", "model_from_engine", "host_loop", "shared_engine", "close_shared_engines", "embed_texts", "aembed_texts"]
