"""AsyncLLMEngine: the engine inside someone else's asyncio app.

Threads: the app's event loop owns admission, scheduling, output routing and detokenization (all
short Python work); the engine core's executor runs the model elsewhere (a dedicated thread with
the default ``uni`` executor, worker processes with ``mp``; torch releases the GIL in its kernels),
so the loop stays responsive while the model computes. The loop awaits the executor's futures.

Overlap: the busy loop keeps up to two steps in flight. While step N executes on the worker,
step N+1 is already scheduled (each running request's in-flight token counted as a placeholder)
and queued behind it, so the worker never waits for Python bookkeeping. When N returns, its tokens
are folded in, step N+2 is scheduled and queued, and only then are N's outputs detokenized and
routed to the streams.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec

from asyncengine.config import EngineConfig
from asyncengine.core.request import Request
from asyncengine.core.request import child_request_id
from asyncengine.engine import gc_policy, validation
from asyncengine.models.sampling_defaults import default_sampling_params
from asyncengine.engine.output_processor import OutputProcessor
from asyncengine.engine.processor import InputProcessor
from asyncengine.engine.request_stream import RequestSlot, RequestStream
from asyncengine.engine.stop_strings import StopAutomaton
from asyncengine.errors import EngineDeadError, EngineOverloaded, InvalidRequestError
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import OutputKind, SamplingParams

if TYPE_CHECKING:
    from asyncengine.core.engine_core import EngineCore

log = logging.getLogger(__name__)

# stop strings longer than this in all are built into their automaton on a worker thread
_STOP_CHARS_OFF_LOOP = 1024


def _is_chat(prompt) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) \
        and isinstance(prompt[0], Mapping)
_HEALTH_CHECK_S = 1.0  # an idle busy loop checks the executor's workers this often


def _check_params(params) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling params must be SamplingParams, not {type(params).__name__}")
    return params


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, core: EngineCore | None = None) -> None:
        with gc_policy.paused(config.freeze_gc_after_load):  # engine/gc_policy.py: ~0.2 s of a start
            self._init(config, core)

    def _init(self, config: EngineConfig, core: EngineCore | None) -> None:
        self.config = config
        self._owns_core = core is None
        # data_parallel_size > 1 or engine_core_process: engine cores in their own processes
        # (engine/core_client.py)
        self._remote = core is None and (config.data_parallel_size > 1 or config.engine_core_process)
        if self._remote:
            from asyncengine.engine.core_client import DPEngineCores
            from asyncengine.models.model_info import load_model_info

            # the cores import torch while this process reads the model's config and tokenizer
            # (this process never imports torch: engine/core_client.py)
            core = DPEngineCores(config, lambda: load_model_info(config))
        elif core is None:
            from asyncengine.core.engine_core import EngineCore

            core = EngineCore(config)
        self.core = core
        self._remote_inbox: deque = deque()  # (core index, message) from the cores' reader threads
        self.tokenizer = self.core.tokenizer
        self.limits = config.limits
        self.processor = InputProcessor(self.tokenizer, self.core.vocab_size, self.core.max_model_len,
                                        self.core.eos_token_ids, self.limits)
        self.output_processor = OutputProcessor(self.tokenizer)
        # what generate() uses without params, and front ends for the fields a caller left out: the
        # checkpoint's generation config, as the front end read it (ModelInfo), else ours
        info = getattr(self.core, "model_info", None)
        self.default_sampling_params = default_sampling_params(getattr(info, "generation_config", None))
        if config.freeze_gc_after_load:
            gc_policy.freeze_after_load()
        self._slots: dict[str, RequestSlot] = {}
        self._compiling: dict[str, asyncio.Future] = {}  # request id -> its grammar's compile
        self._new: list[Request] = []
        self._aborts: set[str] = set()
        # prompt tokens of accepted requests that were never scheduled yet (in _new or waiting in
        # the scheduler), for max_queued_tokens
        self._queued_tokens: dict[str, int] = {}
        self._num_queued_tokens = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._tokenizing: asyncio.Semaphore | None = None  # bounds the worker threads tokenizing
        self._dead: EngineDeadError | None = None
        self._closing = False
        self._closed = False
        # metrics
        self._started_at = time.monotonic()
        self._tokens_out = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens) per step

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLMEngine":
        return cls(config)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "AsyncLLMEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown(drain=False)

    async def start(self) -> None:
        """Bind to the running loop and start the busy loop (also done lazily by generate())."""
        self._bind_loop()

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._dead is not None:
            # a fresh exception each time (re-raising one object grows its traceback forever)
            raise EngineDeadError(str(self._dead)) from self._dead.__cause__
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        if self._loop is not None and self._loop is not loop and self._task is not None \
                and not self._task.done() and not self._loop.is_closed() and self._loop.is_running():
            raise RuntimeError(
                "this AsyncLLMEngine is running on another event loop; use it from that loop "
                "(or from another thread via asyncio.run_coroutine_threadsafe on that loop)")
        # first use, or the old loop is gone (e.g. a second asyncio.run): rebind
        if self._task is not None and not self._task.done():
            self._abandon_all()  # its loop was closed (or stopped) without cancelling the busy loop
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._wake = asyncio.Event()
        self._tokenizing = asyncio.Semaphore(self.limits.max_concurrent_tokenizations)
        if self._remote:
            wake = self._wake

            def sink(index, msg) -> None:  # on a reader thread: hand over, wake the loop
                self._remote_inbox.append((index, msg))
                try:
                    loop.call_soon_threadsafe(wake.set)
                except RuntimeError:  # the loop is closed
                    pass
            self.core.set_sink(sink)
        busy = self._busy_loop_remote() if self._remote else self._busy_loop()
        self._task = loop.create_task(busy, name="asyncengine-busy-loop")

    async def shutdown(self, drain: bool = True) -> None:
        """Stop the engine. drain=True lets running and queued requests finish; drain=False aborts
        them (their streams end with finish_reason "abort")."""
        if self._closed:
            return
        self._closing = True
        if not drain:
            for rid in list(self._slots):
                self._abort_nowait(rid)
        if self._task is not None:
            if not self._task.done():
                self._wake.set()
            try:
                await self._task  # also collects a dead loop's exception ("never retrieved")
            except (EngineDeadError, asyncio.CancelledError):
                pass
        self._closed = True
        if self._owns_core:
            await asyncio.to_thread(self.core.shutdown)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the busy loop runs on (None until started, or once that loop is gone):
        other threads and loops reach the engine through it (``run_coroutine_threadsafe``)."""
        loop = self._loop
        if loop is None or loop.is_closed() or not self.is_running:
            return None
        return loop

    @property
    def errored(self) -> bool:
        return self._dead is not None

    # what front ends (the server, the adapters) may know of the model, without reaching the core
    @property
    def max_model_len(self) -> int:
        return self.processor.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size

    @property
    def dtype(self) -> str:
        """The model's resolved dtype, e.g. "float32", as the core reports it (an engine core in
        another process resolves it there: no torch needed here)."""
        return self.core.dtype

    @property
    def kernels(self) -> str:
        """The dtype and why, and the kernels that run the model (worker/kernel_info.py)."""
        return getattr(self.core, "kernels", "") or self.dtype

    async def check_structured_outputs(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its structured output compiled (structured/compile_service.py: worker
        processes, within the config's GrammarLimits; cancelled with the awaiting task): an
        InvalidRequestError for one that cannot compile, before a request is made of it."""
        from asyncengine.structured.compile_service import prepare

        return await prepare(self.config, self.core, params)

    @property
    def is_closing(self) -> bool:
        """True from the start of shutdown(): new requests are refused (EngineDeadError)."""
        return self._closing

    # ------------------------------------------------------------------ requests

    def generate(self, prompt, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, *, priority: int = 0,
                 cache_salt: str | None = None) -> RequestStream:
        """Submit a request now; returns its async iterator of RequestOutputs (deltas in
        ``out.text_delta`` / ``out.token_ids_delta``; ``out.outputs[0]`` as output_kind says).
        With ``sampling_params.n > 1`` the one stream carries every sample: ``outputs[i]`` has
        ``index`` i (with DELTA, only the samples that changed); it ends when all have finished,
        and aborting it aborts them all. The samples share the prompt's KV blocks.

        ``prompt``: text, token ids, {"prompt_token_ids": [...]} or chat messages
        ([{"role": ..., "content": ...}, ...]). Call it from a coroutine on the app's loop.
        Raises at once: InvalidRequestError for a bad request, EngineOverloaded when the waiting
        queue is full, EngineDeadError once the engine has died or shut down. (A very long text
        prompt is tokenized on a worker thread; its errors surface at the first iteration.)
        """
        self._bind_loop()
        if self._closing:
            raise EngineDeadError("the engine is shutting down")
        if sampling_params is None:  # the model's defaults (models/sampling_defaults.py)
            sampling_params = self.default_sampling_params
        params = _check_params(sampling_params)
        if request_id is None:
            request_id = f"req-{uuid.uuid4().hex[:16]}"
        else:
            validation.check_request_id(request_id, self.limits)
        # the cheap checks before anything is tokenized (they are repeated, harmlessly, later)
        params = validation.check_sampling_params(params, self.limits, self.processor.vocab_size,
                                                  self.processor.eos_token_ids)
        self._check_id_free(request_id, params.n)  # after n is known to be within max_n
        self._check_admissible(params)
        chat = _is_chat(prompt)
        if chat:
            messages = validation.check_messages(prompt, self.limits, self.processor.max_model_len)
            size = validation.messages_chars(messages)
        else:
            text = prompt.get("prompt") if isinstance(prompt, Mapping) and "prompt_token_ids" not in prompt \
                else prompt
            if isinstance(text, str) and self.tokenizer is not None:
                self.processor.check_text(text)
            size = len(text) if isinstance(text, str) else 0
        slot = RequestSlot(request_id, params.output_kind)
        self._slots[request_id] = slot
        long_text = size > self.limits.off_loop_chars and self.tokenizer is not None
        long_stops = sum(len(x) for x in params.stop or ()) > _STOP_CHARS_OFF_LOOP and self.tokenizer is not None
        structured = params.structured_outputs is not None  # its grammar compiles on a worker thread
        if long_text or long_stops or structured:
            # long: tokenized (or rendered) and its stop automaton built on a worker thread; errors
            # surface at the first iteration
            stream = RequestStream(slot, self._abort_slot)
            kind = "chat" if chat else ("text" if long_text else "ready")
            self._loop.create_task(self._submit_later(slot, messages if chat else (text if long_text else prompt),
                                                      kind, params, priority, cache_salt))
            return stream
        try:
            if chat:
                prompt = {"prompt_token_ids": self.processor.render_chat(messages)}
            self._submit(request_id, prompt, params, priority, cache_salt)
        except BaseException:
            del self._slots[request_id]
            raise
        return RequestStream(slot, self._abort_slot)

    def _check_id_free(self, request_id: str, n: int) -> None:
        """A live request's id (or a core id of its samples) cannot be given to another request: its
        outputs and aborts would go to the wrong one."""
        live = self.output_processor.is_live
        if request_id in self._slots or live(request_id) or \
                (n > 1 and any(live(child_request_id(request_id, i)) for i in range(n))):
            raise InvalidRequestError(f"request id {request_id!r} is already in use by a live request")

    def _check_admissible(self, params: SamplingParams) -> None:
        """A request that the admission limits can never let in is a bad request (400), not a
        full queue (429: retry later)."""
        c = self.config
        if c.max_queued_requests is not None and params.n > c.max_queued_requests:
            raise validation.RequestLimitError(
                f"n is {params.n}, but at most max_queued_requests={c.max_queued_requests} samples can ever "
                f"wait at once", param="n", limit="max_queued_requests")

    def check_sampling_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` checked against this engine's limits and vocabulary (what generate() will do
        anyway), for front ends that want to refuse a request before tokenizing its prompt."""
        return validation.check_sampling_params(_check_params(params), self.limits, self.processor.vocab_size,
                                                self.processor.eos_token_ids)

    async def encode(self, prompt) -> tuple[str | None, list[int]]:
        """Check and tokenize a prompt the way generate() will (text, token ids or chat messages):
        ``(text or None, token ids)``. Long ones are tokenized on a worker thread (at most
        ``limits.max_concurrent_tokenizations`` at once). For front ends that need the token count
        before submitting (the HTTP server's context-length errors)."""
        self._bind_loop()
        proc = self.processor
        if _is_chat(prompt):
            messages = validation.check_messages(prompt, self.limits, proc.max_model_len)
            if validation.messages_chars(messages) > self.limits.off_loop_chars:
                async with self._tokenizing:
                    return None, await asyncio.to_thread(proc.render_chat, messages)
            return None, proc.render_chat(messages)
        if isinstance(prompt, str) and self.tokenizer is not None:
            proc.check_text(prompt)
            if len(prompt) > self.limits.off_loop_chars:
                async with self._tokenizing:
                    return await asyncio.to_thread(proc.tokenize, prompt)
        return proc.tokenize(prompt)

    async def _submit_later(self, slot: RequestSlot, prompt, kind: str, params, priority, cache_salt) -> None:
        """kind: "chat" (messages to render), "text" (to tokenize) or "ready" (only the stop
        automaton or the structured-output grammar is long to build)."""
        try:
            if params.structured_outputs is not None:  # compiled (and cached) now: a bad grammar is a 400
                from asyncengine.structured.compile_service import prepare

                compiling = self._compiling[slot.request_id] = asyncio.ensure_future(
                    prepare(self.config, self.core, params))  # an abort cancels it (_mark_abort)
                try:
                    params = await compiling
                except asyncio.CancelledError:
                    if compiling.cancelled() and (slot.request_id in self._aborts
                                                  or self._slots.get(slot.request_id) is not slot):
                        return  # aborted while its grammar compiled (the abort ended its stream)
                    raise
                finally:
                    if self._compiling.get(slot.request_id) is compiling:
                        del self._compiling[slot.request_id]
            async with self._tokenizing:
                if slot.finished or self._slots.get(slot.request_id) is not slot:
                    return  # abandoned while it waited for a thread
                if kind == "chat":
                    prompt = {"prompt_token_ids": await asyncio.to_thread(self.processor.render_chat, prompt)}
                elif kind == "text":
                    _, ids = await asyncio.to_thread(self.processor.tokenize, prompt)
                    prompt = {"prompt": prompt, "prompt_token_ids": ids}
                automaton = await asyncio.to_thread(StopAutomaton, params.stop) if params.stop else None
            if self._slots.get(slot.request_id) is slot and not slot.finished:
                self._submit(slot.request_id, prompt, params, priority, cache_salt, automaton)
        except Exception as e:
            if self._slots.get(slot.request_id) is slot:
                del self._slots[slot.request_id]
            slot.put_error(e)

    def _submit(self, request_id: str, prompt, params, priority, cache_salt, automaton=None) -> None:
        req, text = self.processor.make_request(request_id, prompt, params, priority=priority,
                                                cache_salt=cache_salt)
        self._admit_check(req)
        self.output_processor.add_request(request_id, text, req.prompt_token_ids, req.sampling_params,
                                          req.arrival_time, stop_automaton=automaton)
        self._queued_tokens[request_id] = req.num_prompt_tokens
        self._num_queued_tokens += req.num_prompt_tokens
        self._new.append(req)
        self._wake.set()

    def _admit_check(self, req: Request) -> None:
        c = self.config
        # the scheduler counts each sample of an n > 1 request as one waiting request: so do we
        queued = self.core.num_waiting + sum(r.sampling_params.n for r in self._new)
        if c.max_queued_requests is not None and queued + req.sampling_params.n > c.max_queued_requests:
            raise EngineOverloaded(f"{queued} requests are waiting (max_queued_requests={c.max_queued_requests}); "
                                   f"retry later")
        if c.max_queued_tokens is not None and req.num_prompt_tokens > c.max_queued_tokens:
            raise validation.RequestLimitError(
                f"the prompt is {req.num_prompt_tokens} tokens, but at most max_queued_tokens="
                f"{c.max_queued_tokens} prompt tokens can ever wait at once", param="prompt",
                limit="max_queued_tokens")
        if c.max_queued_tokens is not None and \
                self._num_queued_tokens + req.num_prompt_tokens > c.max_queued_tokens:
            raise EngineOverloaded(f"{self._num_queued_tokens} prompt tokens are waiting "
                                   f"(max_queued_tokens={c.max_queued_tokens}); retry later")

    async def complete(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, **kw) -> RequestOutput:
        """Run one request to the end and return its final output."""
        params = msgspec.structs.replace(_check_params(sampling_params or self.default_sampling_params),
                                         output_kind=OutputKind.FINAL_ONLY)
        final = None
        async for out in self.generate(prompt, params, request_id, **kw):
            final = out
        return final

    async def abort(self, request_id: str) -> None:
        self._abort_nowait(request_id)

    def _abort_nowait(self, request_id: str, slot: RequestSlot | None = None) -> None:
        """Safe from any thread and from __del__: the busy loop applies it at its next turn.
        With ``slot``: only if that slot is still the id's live one (a stream dropped long after its
        request ended must never abort a newer request that reuses the id)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            self._mark_abort(request_id, slot)
        else:
            loop.call_soon_threadsafe(self._mark_abort, request_id, slot)

    def _abort_slot(self, slot: RequestSlot) -> None:
        self._abort_nowait(slot.request_id, slot)

    def _mark_abort(self, request_id: str, slot: RequestSlot | None = None) -> None:
        live = self._slots.get(request_id)
        if live is not None and (slot is None or live is slot):
            self._aborts.add(request_id)
            compiling = self._compiling.pop(request_id, None)
            if compiling is not None:
                compiling.cancel()
            if self._wake is not None:
                self._wake.set()

    # ------------------------------------------------------------------ the busy loop

    def _drain_inputs(self) -> None:
        core = self.core
        if self._new:
            new, self._new = self._new, []
            for req in new:
                if req.request_id in self._aborts:
                    continue  # abandoned before it reached the core
                try:
                    core.add_request(req)
                except Exception as e:  # this request's input: it alone fails
                    self._fail_request(req.request_id, e, "was admitted")
        if self._aborts:
            ids, self._aborts = list(self._aborts), set()
            core.abort_requests(ids)
            for rid in ids:
                self._unqueue(rid)
                st = self.output_processor.abort(rid)
                slot = self._slots.pop(rid, None)
                if slot is not None and not slot.finished:
                    slot.put(self._aborted_output(rid, st))

    def _fail_request(self, rid: str, exc: Exception, stage: str) -> None:
        from asyncengine.errors import RequestFailedError

        log.warning("request %s failed while it %s: %s: %s", rid, stage, type(exc).__name__, exc, exc_info=exc)
        self.core.abort_requests([rid])
        self.output_processor.abort(rid)
        self._unqueue(rid)
        err = RequestFailedError(f"request {rid!r} failed while it {stage}: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        slot = self._slots.pop(rid, None)
        if slot is not None:
            slot.put_error(err)

    def _unqueue(self, rid: str) -> None:
        self._num_queued_tokens -= self._queued_tokens.pop(rid, 0)

    def _schedule(self):
        so = self.core.schedule()
        for nr in so.new_requests:  # scheduled for the first time: no longer queued
            rid = self.output_processor.request_id_of(nr.req_id)  # n > 1: the sample's request
            if rid in self._queued_tokens:
                self._unqueue(rid)
        return so

    def _aborted_output(self, rid: str, state=None) -> RequestOutput:
        """The last output of an aborted stream: what it had (every sample "abort"), if known."""
        if state is not None:
            return self.output_processor.make_output(state)
        from asyncengine.outputs import CompletionOutput
        return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[],
                             outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")],
                             finished=True)

    async def _busy_loop(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        depth = 2 if self.config.async_scheduling else 1
        inflight: deque = deque()
        try:
            while True:
                self._drain_inputs()
                if not inflight and not core.has_unfinished():
                    if self._closing:
                        return
                    self._wake.clear()
                    if self._new or self._aborts:
                        continue
                    try:  # idle: look at the workers' health now and then (a dead one kills us now)
                        await asyncio.wait_for(self._wake.wait(), timeout=_HEALTH_CHECK_S)
                    except asyncio.TimeoutError:
                        core.check_health()
                    continue
                while len(inflight) < depth and core.has_unfinished():
                    so = self._schedule()
                    if so.is_empty and not so.finished_req_ids:
                        break
                    inflight.append((so, asyncio.wrap_future(core.execute_model(so), loop=loop)))
                    if so.is_empty:
                        break
                if not inflight:
                    # work exists but none is schedulable now (cannot happen with a sane config):
                    # wait for an input instead of spinning
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), timeout=0.01)
                    except asyncio.TimeoutError:
                        pass
                    continue
                so, fut = inflight.popleft()
                out = await fut
                core_outputs = core.update(so, out)
                # queue the next step before the Python work on this one's outputs
                if len(inflight) < depth and core.has_unfinished():
                    self._drain_inputs()
                    nxt = self._schedule()
                    if not nxt.is_empty or nxt.finished_req_ids:
                        inflight.append((nxt, asyncio.wrap_future(core.execute_model(nxt), loop=loop)))
                await self._route(core_outputs)
        except asyncio.CancelledError:
            # the loop is going away (asyncio.run cancels every task it leaves behind): end this
            # loop's requests but keep the engine usable from the next loop. Steps already handed to
            # the model thread still run there: their blocks are already in the prefix cache.
            inflight.clear()
            if self._task is asyncio.current_task():
                self._abandon_all()
            raise
        except GeneratorExit:
            # the coroutine is being destroyed with its closed loop (the engine has moved on to
            # another loop, or is garbage): not a fault, and that loop can no longer be touched
            inflight.clear()
            raise
        except BaseException as e:  # a model fault: every waiter learns why, nobody hangs
            dead = EngineDeadError(f"the engine died: {type(e).__name__}: {e}")
            dead.__cause__ = e
            log.exception("asyncengine busy loop died")
            self._fail_all(dead)
            raise dead from e
        finally:
            for _, fut in inflight:
                fut.cancel()

    async def _busy_loop_remote(self) -> None:
        """The busy loop with data-parallel engine cores: they step on their own; this loop sends
        them inputs and routes what they send back."""
        core = self.core
        try:
            while True:
                self._drain_inputs()
                while self._remote_inbox:
                    index, msg = self._remote_inbox.popleft()
                    if not hasattr(msg, "outputs"):  # CoreDead: its requests fail, or the engine dies
                        self._core_died(index, msg)
                        continue
                    for o in msg.outputs:
                        rid = self.output_processor.request_id_of(o.req_id)
                        if rid in self._queued_tokens:
                            self._unqueue(rid)
                    await self._route(msg.outputs)
                if self._closing and not self._slots and not self._new:
                    return
                self._wake.clear()
                if self._new or self._aborts or self._remote_inbox:
                    continue
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=_HEALTH_CHECK_S)
                except asyncio.TimeoutError:
                    core.check_health()
        except asyncio.CancelledError:
            if self._task is asyncio.current_task():
                self._abandon_all()
            raise
        except GeneratorExit:
            raise
        except BaseException as e:
            dead = EngineDeadError(f"the engine died: {type(e).__name__}: {e}")
            dead.__cause__ = e
            log.exception("asyncengine busy loop died")
            self._fail_all(dead)
            raise dead from e

    def _core_died(self, index: int, msg) -> None:
        """An engine core is gone (engine/dp_health.py): its requests fail with EngineCoreDied and
        the other cores go on; with none left, EngineDeadError (the traceback goes to the log only)."""
        log.error("engine core %d died: %s%s", index, msg.message, f"\n{msg.traceback}" if msg.traceback else "")
        died = getattr(self.core, "core_died", None)
        lost = died(index) if died is not None else None
        if lost is None:
            raise EngineDeadError(msg.message)
        from asyncengine.errors import EngineCoreDied

        for crid in lost:
            rid = self.output_processor.request_id_of(crid)
            self.output_processor.abort(rid)
            self._unqueue(rid)
            slot = self._slots.pop(rid, None)
            if slot is not None and not slot.finished:
                slot.put_error(EngineCoreDied(f"request {rid!r} was on engine core {index}, which died "
                                              f"({msg.message}); the other cores go on: retry it"))

    def _abandon_all(self) -> None:
        """End every request of the loop the engine leaves (its streams get an "abort" output) and
        empty the core, so that the next loop starts clean."""
        for slot in self._slots.values():
            if not slot.finished:
                try:
                    slot.put(self._aborted_output(slot.request_id))
                except RuntimeError:  # its loop is closed: nobody can read it anyway
                    pass
        self.core.abort_all()  # the workers forget them once the steps already queued are done
        for rid in list(self.output_processor.states):
            self.output_processor.abort(rid)
        self._slots.clear()
        self._new.clear()
        self._aborts.clear()
        self._queued_tokens.clear()
        self._num_queued_tokens = 0

    def _fail_all(self, dead: EngineDeadError) -> None:
        self._dead = dead
        for slot in self._slots.values():
            slot.put_error(dead)
        self._slots.clear()
        self._new.clear()
        self._queued_tokens.clear()
        self._num_queued_tokens = 0

    async def _route(self, core_outputs) -> None:
        if not core_outputs:
            return
        self._tokens_out += sum(len(c.new_token_ids) for c in core_outputs)
        self._recent.append((time.monotonic(), self._tokens_out))
        processed = self.output_processor.process(core_outputs)
        if processed.to_abort:
            self.core.abort_requests(processed.to_abort)
        for rid, err in processed.failed:  # that request alone fails; the engine goes on
            log.warning("request %s failed: %s", rid, err, exc_info=err.__cause__)
            self._unqueue(rid)
            slot = self._slots.pop(rid, None)
            if slot is not None:
                slot.put_error(err)
        for i, out in enumerate(processed.outputs):
            slot = self._slots.get(out.request_id)
            if slot is not None:
                slot.put(out)
                if out.finished:
                    del self._slots[out.request_id]
                    if self._remote:
                        self.core.finished(out.request_id)
            if i % 256 == 255:
                await asyncio.sleep(0)  # let the app breathe between chunks of a big batch

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict:
        s = self.core.stats()
        now = time.monotonic()
        tps = 0.0
        if len(self._recent) >= 2:
            (t0, n0), (t1, n1) = self._recent[0], self._recent[-1]
            if now - t1 < 5.0 and t1 > t0:
                tps = (n1 - n0) / (t1 - t0)
        s.update({
            "num_streams": len(self._slots),
            "tokens_per_s": tps,
            "total_output_tokens": self._tokens_out,
            "uptime_s": now - self._started_at,
            "errored": self.errored,
        })
        return s
