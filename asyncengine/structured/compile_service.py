"""Grammar compilation as a bounded, cancellable service (one per process and tokenizer).

Front ends (the async engine, ``LLM``, the server through the engine) hand it a request's
``StructuredOutputsParams``; it answers the same params with ``compiled`` set (xgrammar's
serialized grammar), so that a core in another process deserializes (milliseconds) instead of
compiling inside its step loop (issue 27: a 10k enum froze every stream of its core for 24.7 s).

* Cheap checks first (``limits.check_upfront``): what can be refused without compiling is a 400.
* A hit in the process's byte-bounded LRU (``cache.py``) costs nothing more; identical compiles in
  flight are shared; a grammar that failed is remembered (by digest, bounded) and refused at once.
* Otherwise it compiles in one of ``grammar_compile_workers`` worker processes
  (``compile_worker.py``), driven by this service's own threads (never the event loop's default
  executor, which tokenization uses). Past ``max_grammar_compile_s``, or when every request
  waiting for it was cancelled (aborted, client gone), the worker is killed and a fresh one is
  started at once in the background.
* A worker is small (it imports xgrammar's compiler only: compile_worker.import_compiler) and its
  memory is returned: after ``worker_pipe.WORKER_MAX_COMPILES`` compiles, or once its resident memory
  is over ``worker_pipe.WORKER_MAX_RSS``, it is replaced by a fresh one (a compiler's arenas only grow).
* :func:`warm_up` starts the workers ahead of the first request (``serve`` does, before it
  listens), so that the first structured request costs what a later one does.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import queue
import threading
from collections import OrderedDict

import msgspec

from asyncengine.errors import EngineOverloaded, InvalidRequestError
from asyncengine.structured.worker_pipe import Cancelled, Overdue, Worker
from asyncengine.structured.cache import CompiledEntry
from asyncengine.config.grammar_limits import GrammarLimitError, GrammarLimits, check_upfront
from asyncengine.structured_params import StructuredOutputsParams

log = logging.getLogger(__name__)

_FAILED_KEYS = 1024  # failed grammars remembered (a 32-byte digest and a message each)


class _Flight:
    """One compile in progress and the requests waiting for it (cancelled when none is left)."""

    def __init__(self) -> None:
        self.cancel = threading.Event()
        self.future: concurrent.futures.Future | None = None
        self.waiters = 0


class CompileService:
    """Compiles grammars of one tokenizer (``compiler``: its backend.GrammarCompiler, whose cache
    this fills) in worker processes, within ``limits``. Thread-safe; usable from any event loop."""

    def __init__(self, compiler, limits: GrammarLimits) -> None:
        self.compiler = compiler
        self.limits = limits
        self._info = compiler.info.serialize_json()
        n = limits.grammar_compile_workers
        self._pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="grammar-compile")
        self._workers: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(n):
            self._workers.put(None)  # started by the first compile that needs it
        self._lock = threading.Lock()
        self._flights: dict = {}
        self._failed: OrderedDict = OrderedDict()
        self._closed = False
        self.stats = {"compiles": 0, "hits": 0, "refused": 0, "timeouts": 0, "cancelled": 0, "killed": 0,
                      "recycled": 0}

    def warm(self) -> None:
        """Start every worker now (not at the first compile); returns once they are ready."""
        started = []
        for _ in range(self.limits.grammar_compile_workers):
            w = self._workers.get()
            if w is None or not w.alive():
                w = Worker(self._info)
            started.append(w)
        try:
            for w in started:
                w.wait_ready(threading.Event())
        finally:
            for w in started:
                self._workers.put(w)

    # ------------------------------------------------------------------ front-end API

    async def compile(self, p: StructuredOutputsParams) -> StructuredOutputsParams:
        """``p`` with ``compiled`` set; raises GrammarLimitError / InvalidRequestError (400s).
        Cancelling the awaiting task abandons the compile (killed when nobody else waits for it)."""
        hit = self._cached(p)
        if hit is not None:
            return hit
        flight, key = self._join(p)
        try:
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            flight.future.add_done_callback(lambda f: _wake(loop, waiter, f))
            entry = await waiter
        finally:
            self._leave(flight, key)
        return msgspec.structs.replace(p, compiled=entry.serialized)

    def compile_blocking(self, p: StructuredOutputsParams) -> StructuredOutputsParams:
        """The same, for synchronous front ends (``LLM``)."""
        hit = self._cached(p)
        if hit is not None:
            return hit
        flight, key = self._join(p)
        try:
            entry = flight.future.result()
        finally:
            self._leave(flight, key)
        return msgspec.structs.replace(p, compiled=entry.serialized)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for f in self._flights.values():
                f.cancel.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        while True:
            try:
                w = self._workers.get_nowait()
            except queue.Empty:
                break
            if w is not None:
                w.kill()

    # ------------------------------------------------------------------ internals

    def _cached(self, p: StructuredOutputsParams) -> StructuredOutputsParams | None:
        key = p.key
        entry = self.compiler.cache.get(key)
        if entry is not None and entry.serialized is not None:
            self.stats["hits"] += 1
            return msgspec.structs.replace(p, compiled=entry.serialized)
        failed = self._failed.get(_digest(key))
        if failed is not None:
            self.stats["refused"] += 1
            raise failed[0](failed[1], **failed[2])
        try:
            check_upfront(*key, self.limits)
        except GrammarLimitError:
            self.stats["refused"] += 1
            raise
        return None

    def _join(self, p: StructuredOutputsParams) -> tuple[_Flight, tuple]:
        key = p.key
        with self._lock:
            if self._closed:
                raise InvalidRequestError("structured_outputs: the grammar compiler is shut down")
            flight = self._flights.get(key)
            if flight is None:
                flight = self._flights[key] = _Flight()
                flight.future = self._pool.submit(self._run, key, flight)
            flight.waiters += 1
        return flight, key

    def _leave(self, flight: _Flight, key) -> None:
        with self._lock:
            flight.waiters -= 1
            if flight.waiters == 0:
                if self._flights.get(key) is flight:
                    del self._flights[key]
                if not flight.future.done():
                    flight.cancel.set()  # nobody wants it any more: its worker is killed
                    self.stats["cancelled"] += 1

    def _run(self, key, flight: _Flight) -> CompiledEntry:
        """On a service thread: compile ``key`` in a worker process within the budget."""
        kind, text = key
        if flight.cancel.is_set():
            raise GrammarLimitError("structured_outputs: the compile was abandoned")
        worker = self._workers.get()
        try:
            if worker is None or not worker.alive():
                worker = Worker(self._info)
            worker.wait_ready(flight.cancel)
            self.stats["compiles"] += 1
            result = worker.compile(kind, text, self.limits.max_grammar_compile_s, flight.cancel)
        except (Cancelled, Overdue, EOFError, OSError) as e:
            if worker is not None:
                worker.kill()
                self.stats["killed"] += 1
            worker = None if self._closed else Worker(self._info)  # warm for the next compile
            if isinstance(e, Cancelled):
                raise GrammarLimitError("structured_outputs: the compile was abandoned") from None
            if isinstance(e, Overdue):
                self.stats["timeouts"] += 1
                err = (GrammarLimitError, f"structured_outputs: the {kind.split('_')[0]} did not compile within "
                       f"max_grammar_compile_s={self.limits.max_grammar_compile_s:g} s of CPU time (server flag "
                       "--max-grammar-compile-s): simplify it (fewer enum values or alternatives, smaller "
                       "repetition bounds)", {"limit": "max_grammar_compile_s"})
                self._remember_failure(key, err)
                raise err[0](err[1], **err[2])
            log.warning("grammar compile worker failed: %s", e)
            if isinstance(e, EOFError):  # it died on this grammar (a crash in the compiler)
                raise GrammarLimitError(f"structured_outputs: the {kind.split('_')[0]} could not be compiled "
                                        "(the compiler crashed on it)") from None
            raise EngineOverloaded("structured_outputs: the grammar compiler is not available right now: "
                                   f"retry ({e})") from None
        finally:
            if worker is not None and worker.alive() and worker.worn() and not self._closed:
                worker.kill()  # return its memory: a fresh one is ready for the next compile
                self.stats["recycled"] += 1
                worker = Worker(self._info)
            self._workers.put(worker)
        if not result.ok:
            err = (InvalidRequestError, f"structured_outputs: the {kind.split('_')[0]} does not compile: "
                   f"{result.error}", {})
            self._remember_failure(key, err)
            raise err[0](err[1])
        return self.compiler.cache.put(key, CompiledEntry(result.compiled))

    def _remember_failure(self, key, err) -> None:
        with self._lock:
            self._failed[_digest(key)] = err
            while len(self._failed) > _FAILED_KEYS:
                self._failed.popitem(last=False)


def _wake(loop: asyncio.AbstractEventLoop, waiter: asyncio.Future, f: concurrent.futures.Future) -> None:
    try:
        loop.call_soon_threadsafe(_settle, waiter, f)
    except RuntimeError:  # that loop is closed: nobody waits there any more
        pass


def _settle(waiter: asyncio.Future, f: concurrent.futures.Future) -> None:
    if waiter.done():  # its request was cancelled meanwhile
        return
    if f.cancelled():  # the service shut down before it ran
        waiter.set_exception(InvalidRequestError("structured_outputs: the grammar compiler is shut down"))
        return
    e = f.exception()
    if e is not None:
        waiter.set_exception(e)
    else:
        waiter.set_result(f.result())


def _digest(key: tuple[str, str]) -> bytes:
    return hashlib.sha256(key[0].encode() + b"\0" + key[1].encode("utf-8", "surrogatepass")).digest()


_services: dict = {}
_services_lock = threading.Lock()


def service_for(config, core) -> CompileService:
    """The process's compile service for ``config``'s tokenizer (built on first use: the
    tokenizer's vocabulary is read once, ~0.7 s for a 49k vocabulary)."""
    from asyncengine.structured.backend import compiler_for  # lazy: the grammar backend (xgrammar) loads only in the compile process

    if core.tokenizer is None:
        raise InvalidRequestError("structured_outputs needs a tokenizer (skip_tokenizer_init is on)")
    limits = getattr(config, "grammar_limits", None) or GrammarLimits()
    key = _service_key(config)
    with _services_lock:
        s = _services.get(key)
        if s is None:
            compiler = compiler_for(config.tokenizer or config.model, core.tokenizer, core.vocab_size,
                                    core.eos_token_ids, limits)
            s = _services[key] = CompileService(compiler, limits)
        return s


def warm_up(config, core) -> None:
    """Build ``config``'s compile service and start its workers now (``serve`` does, before it
    listens), so that a server's first structured request costs what a later one does. A failure
    is logged: the first structured request then starts them, and reports why not."""
    try:
        service_for(config, core).warm()
    except Exception as e:  # noqa: BLE001
        log.warning("grammar compile workers not started ahead: %s", e)


def _service_key(config) -> tuple:
    return (config.tokenizer or config.model, getattr(config, "grammar_limits", None) or GrammarLimits())


async def prepare(config, core, params):
    """Front ends: ``params`` (SamplingParams) with its structured output compiled (a 400 when it
    cannot be, within the limits). Unchanged when it has none."""
    p = params.structured_outputs
    if p is None or not p.has_grammar:  # none, or a reasoning budget alone: nothing to compile
        return params
    service = _services.get(_service_key(config))
    if service is None:  # the first one reads the vocabulary: not on the event loop
        service = await asyncio.to_thread(service_for, config, core)
    return msgspec.structs.replace(params, structured_outputs=await service.compile(p))


def prepare_blocking(config, core, params):
    p = params.structured_outputs
    if p is None or not p.has_grammar:
        return params
    return msgspec.structs.replace(params, structured_outputs=service_for(config, core).compile_blocking(p))
