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
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict

import msgspec

from asyncengine.errors import EngineOverloaded, InvalidRequestError
from asyncengine.structured import compile_worker as cw
from asyncengine.structured.cache import CompiledEntry
from asyncengine.config.grammar_limits import GrammarLimitError, GrammarLimits, check_upfront
from asyncengine.structured_params import StructuredOutputsParams

log = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0  # importing xgrammar and reading the tokenizer: ~4 s on a busy 2-core host
_POLL_S = 0.05  # how soon a cancelled or overdue compile notices
WALL_FACTOR = 4  # a compile's wall-clock backstop, in multiples of its CPU budget
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_FAILED_KEYS = 1024  # failed grammars remembered (a 32-byte digest and a message each)


class _Cancelled(Exception):
    pass


class _Overdue(Exception):
    pass


class _Worker:
    """One compile worker process and the pipe to it."""

    def __init__(self, tokenizer_info: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "asyncengine.structured.compile_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(cw.FromWorker)
        self.ready = False
        self._send(cw.Hello(tokenizer_info))  # the pipe buffers it while the child imports

    def _send(self, msg) -> None:
        body = self._enc.encode(msg)
        self.proc.stdin.write(cw._HEADER.pack(len(body)) + body)
        self.proc.stdin.flush()

    def _read_exact(self, n: int, overdue, cancel: threading.Event | None) -> bytes:
        fd = self.proc.stdout.fileno()
        buf = bytearray()
        while len(buf) < n:
            if cancel is not None and cancel.is_set():
                raise _Cancelled
            if overdue():
                raise _Overdue
            r, _, _ = select.select([fd], [], [], _POLL_S)
            if r:
                chunk = os.read(fd, n - len(buf))
                if not chunk:
                    raise EOFError(f"the grammar compile worker exited ({self.proc.poll()})")
                buf += chunk
        return bytes(buf)

    def _recv(self, overdue, cancel: threading.Event | None):
        (size,) = cw._HEADER.unpack(self._read_exact(cw._HEADER.size, overdue, cancel))
        return self._dec.decode(self._read_exact(size, overdue, cancel))

    def cpu_s(self) -> float | None:
        """CPU seconds the worker has used (Linux /proc; None elsewhere)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _TICKS
        except (OSError, IndexError, ValueError):
            return None

    def wait_ready(self, cancel: threading.Event) -> None:
        if not self.ready:
            deadline = time.monotonic() + WORKER_START_TIMEOUT_S
            try:
                msg = self._recv(lambda: time.monotonic() > deadline, cancel)
            except _Overdue:
                raise OSError(f"the grammar compile worker did not start in {WORKER_START_TIMEOUT_S:.0f} s") from None
            assert isinstance(msg, cw.Ready), msg
            self.ready = True

    def compile(self, kind: str, text: str, budget_s: float, cancel: threading.Event) -> cw.Result:
        """The budget is the worker's CPU time (a compile starved by a busy host, at nice 10, is
        not the client's fault), with ``WALL_FACTOR`` x of wall time as the backstop."""
        cpu0 = self.cpu_s()
        wall = time.monotonic() + WALL_FACTOR * budget_s
        self._send(cw.Job(kind, text))

        def overdue() -> bool:
            if time.monotonic() > wall:
                return True
            cpu = self.cpu_s() if cpu0 is not None else None
            return cpu is not None and cpu - cpu0 > budget_s

        return self._recv(overdue, cancel)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


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
        self.stats = {"compiles": 0, "hits": 0, "refused": 0, "timeouts": 0, "cancelled": 0, "killed": 0}

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
                worker = _Worker(self._info)
            worker.wait_ready(flight.cancel)
            self.stats["compiles"] += 1
            result = worker.compile(kind, text, self.limits.max_grammar_compile_s, flight.cancel)
        except (_Cancelled, _Overdue, EOFError, OSError) as e:
            if worker is not None:
                worker.kill()
                self.stats["killed"] += 1
            worker = None if self._closed else _Worker(self._info)  # warm for the next compile
            if isinstance(e, _Cancelled):
                raise GrammarLimitError("structured_outputs: the compile was abandoned") from None
            if isinstance(e, _Overdue):
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
    from asyncengine.structured.backend import compiler_for

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
