"""AsyncLLMEngine: the engine inside someone else's asyncio app.

Threads: the app's event loop owns admission, output routing and detokenization (all short
Python work); the engine core's executor runs the model elsewhere (a dedicated thread with the
default ``uni`` executor, worker processes with ``mp``; torch releases the GIL in its kernels), so
the loop stays responsive while the model computes.

The engine binds a busy loop (engine/busy_loop.py) to the app's loop, which hands its inputs to
one ``CoreClient`` (engine/core_client.py) wherever the core runs and routes each finished batch's
outputs; the engine itself checks and submits requests and answers the public API.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import TYPE_CHECKING

from asyncengine.config import EngineConfig
from asyncengine.core.request import child_request_id
from asyncengine.engine_core import gc_policy
from asyncengine.engine import validation
from asyncengine.engine.admission import Admission
from asyncengine.engine.busy_loop import BusyLoop
from asyncengine.engine.core_client import CoreClient
from asyncengine.engine.lora_registry import NamedLoRAs
from asyncengine.engine.output_processor import OutputProcessor
from asyncengine.multimodal.processor import MultiModalProcessor
from asyncengine.engine.processor import InputProcessor, check_lora_request
from asyncengine.engine.protocol import EngineClient
from asyncengine.engine.prompt_intake import PromptIntake, check_params
from asyncengine.engine.request_stream import RequestSlot, RequestStream
from asyncengine.engine.stream_router import StreamRouter
from asyncengine.engine.trainer_api import TrainerControls
from asyncengine.models.pooling_models import check_request, default_pooling, supported_tasks
from asyncengine.models.sampling_defaults import default_sampling_params
from asyncengine.errors import EngineDeadError, InvalidRequestError
from asyncengine.lora_request import LoRARequest
from asyncengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncengine.engine_core.core import EngineCore


class AsyncLLMEngine(TrainerControls, NamedLoRAs, EngineClient):  # trainer_api.py, lora_registry.py
    def __init__(self, config: EngineConfig, core: EngineCore | None = None) -> None:
        with gc_policy.paused(config.freeze_gc_after_load):  # engine_core/gc_policy.py: ~0.2 s of a start
            self._init(config, core)

    def _init(self, config: EngineConfig, core: EngineCore | None) -> None:
        self.config = config
        self._owns_core = core is None
        # the core in this process, or engine cores in their own processes (data_parallel_size > 1,
        # engine_core_process): one interface either way
        self.client = CoreClient.make(config, core)
        self.tokenizer = self.client.tokenizer
        self.limits = config.limits
        self.processor = InputProcessor(self.tokenizer, self.client.vocab_size, self.client.max_model_len,
                                        self.client.eos_token_ids, self.limits,
                                        self.client.model_info.generation_config,
                                        mm=MultiModalProcessor.of(self.config.multimodal_config, self.client.model_info,
                                                                  self.config.model_impl))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._lora_folders: dict[int, str] = {}  # LoRA id -> its folder: one id never names two adapters
        self.intake = PromptIntake(self.processor, self.limits)
        self.admission = Admission(config)
        # what a request with no sampling fields decodes with (the processor fills unset fields
        # from the same values): the checkpoint's generation config, then the engine's table
        self.default_sampling_params = default_sampling_params(self.client.model_info.generation_config)
        info = self.client.model_info  # what the model serves (an encoder: pooling only)
        self._tasks, self._default_pooling = supported_tasks(info.hf_config, config.runner), \
            default_pooling(info.hf_config, info.path)
        if config.freeze_gc_after_load:
            gc_policy.freeze_after_load()
        self.router = StreamRouter(self.output_processor, self.admission, self.client)
        self._busy_loop = BusyLoop(self.client, self.router)  # new requests and aborts wait in it
        self._compiling: dict[str, asyncio.Future] = {}  # request id -> its grammar's compile
        self._control_lock = asyncio.Lock()  # weight updates, sleep/wake: one at a time
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._closed = False
        # metrics
        self._started_at = time.monotonic()

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineClient:
        """The front end a config asks for: this class for one core (in this process, in its own,
        data-parallel cores, Ray actors), a ``PDEngine`` for ``prefill_cores``/``decode_cores``."""
        if config.prefill_cores or config.decode_cores:
            from asyncengine.engine.pd_client import PDEngine  # lazy: only P/D configs need it

            return PDEngine(config, core_engine=cls)
        return cls(config)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind to the running loop and start the busy loop (also done lazily by generate())."""
        self._bind_loop()

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        busy = self._busy_loop
        if busy.dead is not None:
            # a fresh exception each time (re-raising one object grows its traceback forever)
            raise EngineDeadError(str(busy.dead)) from busy.dead.__cause__
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        if self._loop is loop and busy.is_running:
            return
        if self._loop is not None and self._loop is not loop and busy.is_running \
                and not self._loop.is_closed() and self._loop.is_running():
            raise RuntimeError(
                "this AsyncLLMEngine is running on another event loop; use it from that loop "
                "(or from another thread via asyncio.run_coroutine_threadsafe on that loop)")
        # first use, or the old loop is gone (e.g. a second asyncio.run): rebind
        if busy.is_running:
            busy.abandon_all()  # its loop was closed (or stopped) without cancelling the busy loop
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self.intake.bind()
        busy.start(loop)

    async def shutdown(self, drain: bool = True) -> None:
        """Stop the engine. drain=True lets running and queued requests finish; drain=False aborts
        them (their streams end with finish_reason "abort")."""
        if self._closed:
            return
        busy = self._busy_loop
        busy.closing = True
        if not drain:
            for rid in list(self._slots):
                self._abort_nowait(rid)
        if busy.task is not None:
            if not busy.task.done():
                busy.wake.set()
            try:
                await busy.task  # also collects a dead loop's exception ("never retrieved")
            except (EngineDeadError, asyncio.CancelledError):
                pass
        self._closed = True
        if self._owns_core:
            await asyncio.to_thread(self.client.shutdown)

    @property
    def is_running(self) -> bool:
        return self._busy_loop.is_running

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
        return self._busy_loop.dead is not None

    @property
    def _slots(self) -> dict[str, RequestSlot]:
        """The live streams, by request id (the router's)."""
        return self.router.slots

    @property
    def core(self) -> "EngineCore | None":
        """The engine core when it runs in this process (None when cores run in their own):
        for introspection and tests; the engine itself talks to ``self.client``."""
        return self.client.core

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
        return self.client.dtype

    def cores_alive(self) -> tuple[int, int]:
        """(engine cores alive, engine cores): data parallel serves on with fewer (engine/dp_health.py)."""
        return self.client.cores_alive()

    @property
    def kv_transfer_address(self) -> str | None:
        """Where this engine's P/D prefill core serves its transfers (tcp), as decode cores reach
        it (the port its node's OS picked); None for any other engine."""
        return self.client.kv_transfer_address

    @property
    def kernels(self) -> str:
        """The dtype and why, and the kernels that run the model (worker/kernel_info.py)."""
        return self.client.kernels or self.dtype

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return self._tasks

    @property
    def default_pooling(self) -> str:
        return self._default_pooling

    async def check_structured_outputs(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its structured output compiled (structured/compile_service.py: worker
        processes, within the config's GrammarLimits; cancelled with the awaiting task): an
        InvalidRequestError for one that cannot compile, before a request is made of it."""
        from asyncengine.structured.compile_service import prepare  # lazy: the front end imports no torch: core code loads only where it runs here

        return await prepare(self.config, self.client, params)

    @property
    def is_closing(self) -> bool:
        """True from the start of shutdown(): new requests are refused (EngineDeadError)."""
        return self._busy_loop.closing

    # ------------------------------------------------------------------ requests

    def generate(self, prompt, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, *, priority: int = 0,
                 cache_salt: str | None = None, kv_transfer_params: dict[str, str] | None = None,
                 lora_request: LoRARequest | None = None) -> RequestStream:
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
        ``kv_transfer_params``: for the P/D front end (engine/pd_client.py), where this request's
        prompt KV waits (``{"source": "host:port"}`` of the prefill core that computed it).
        ``lora_request``: the PEFT adapter to run under (needs ``enable_lora``; docs/lora.md).
        """
        self._bind_loop()
        if self._busy_loop.closing:
            raise EngineDeadError("the engine is shutting down")
        # unset fields: the model's defaults (models/sampling_defaults.py), here, once
        params = self.processor.resolve(check_params(sampling_params))
        if request_id is None:
            request_id = f"req-{uuid.uuid4().hex[:16]}"
        else:
            validation.check_request_id(request_id, self.limits)
        # the cheap checks before anything is tokenized (they are repeated, harmlessly, later)
        params = validation.check_sampling_params(params, self.limits, self.processor.vocab_size,
                                                  self.processor.eos_token_ids)
        self._check_id_free(request_id, params.n)  # after n is known to be within max_n
        check_request(self._tasks, params)  # an encoder cannot generate, a decoder cannot rerank
        check_lora_request(lora_request, self.config, self.client.model_info.hf_config, self._lora_folders)
        self.admission.check_admissible(params)
        kind, payload = self.intake.precheck(prompt, params)
        slot = RequestSlot(request_id, params.output_kind)
        self._slots[request_id] = slot
        if kind != "now":  # prepared on worker threads; errors surface at the first iteration
            self._loop.create_task(self._submit_later(slot, kind, payload, params, priority, cache_salt,
                                                      kv_transfer_params, lora_request))
            return RequestStream(slot, self._abort_slot)
        try:
            self._submit(request_id, payload, params, priority, cache_salt, kv_transfer_params=kv_transfer_params,
                         lora_request=lora_request)
        except BaseException:
            del self._slots[request_id]
            raise
        return RequestStream(slot, self._abort_slot)

    def _check_lora(self, lora_request: LoRARequest) -> None:
        check_lora_request(lora_request, self.config, self.client.model_info.hf_config, self._lora_folders)

    def _check_id_free(self, request_id: str, n: int) -> None:
        """A live request's id (or a core id of its samples) cannot be given to another request: its
        outputs and aborts would go to the wrong one."""
        live = self.output_processor.is_live
        if request_id in self._slots or live(request_id) or \
                (n > 1 and any(live(child_request_id(request_id, i)) for i in range(n))):
            raise InvalidRequestError(f"request id {request_id!r} is already in use by a live request")

    def check_sampling_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its unset fields resolved (the model's defaults) and checked against this
        engine's limits and vocabulary (what generate() will do anyway), for front ends that want to
        refuse a request before tokenizing its prompt, or to know what it will decode with."""
        return validation.check_sampling_params(self.processor.resolve(check_params(params)), self.limits,
                                                self.processor.vocab_size, self.processor.eos_token_ids)

    async def encode(self, prompt) -> tuple[str | None, list[int]]:
        """Check and tokenize a prompt the way generate() will (text, token ids or chat messages):
        ``(text or None, token ids)``. Long ones are tokenized on a worker thread (at most
        ``limits.max_concurrent_tokenizations`` at once). For front ends that need the token count
        before submitting (the HTTP server's context-length errors)."""
        self._bind_loop()
        return await self.intake.encode(prompt)

    async def _submit_later(self, slot: RequestSlot, kind: str, payload, params, priority, cache_salt,
                            kv_transfer_params=None, lora_request=None) -> None:
        """Prepare on worker threads what ``intake.precheck`` left for later, then submit."""
        def still_wanted() -> bool:
            return self._slots.get(slot.request_id) is slot and not slot.finished
        try:
            if params.structured_outputs is not None:  # compiled (and cached) now: a bad grammar is a 400
                from asyncengine.structured.compile_service import prepare  # lazy: the front end imports no torch: core code loads only where it runs here

                compiling = self._compiling[slot.request_id] = asyncio.ensure_future(
                    prepare(self.config, self.client, params))  # an abort cancels it (_mark_abort)
                try:
                    params = await compiling
                except asyncio.CancelledError:
                    if compiling.cancelled() and (slot.request_id in self._busy_loop.aborts or not still_wanted()):
                        return  # aborted while its grammar compiled (the abort ended its stream)
                    raise
                finally:
                    if self._compiling.get(slot.request_id) is compiling:
                        del self._compiling[slot.request_id]
            ready = await self.intake.prepare(kind, payload, params, still_wanted)
            if ready is not None and still_wanted():
                self._submit(slot.request_id, ready[0], params, priority, cache_salt, ready[1],
                             kv_transfer_params=kv_transfer_params, lora_request=lora_request)
        except Exception as e:
            if self._slots.get(slot.request_id) is slot:
                del self._slots[slot.request_id]
            slot.put_error(e)

    def _submit(self, request_id: str, prompt, params, priority, cache_salt, automaton=None,
                kv_transfer_params=None, lora_request=None) -> None:
        req, text = self.processor.make_request(request_id, prompt, params, priority=priority,
                                                cache_salt=cache_salt, lora_request=lora_request)
        req.kv_transfer_params = kv_transfer_params
        # the scheduler counts each sample of an n > 1 request as one waiting request: so do we
        busy = self._busy_loop
        self.admission.check(req, self.client.num_waiting + sum(r.sampling_params.n for r in busy.new))
        self.output_processor.add_request(request_id, text, req.prompt_token_ids, req.sampling_params,
                                          req.arrival_time, stop_automaton=automaton)
        self.admission.add(request_id, req.num_prompt_tokens)
        busy.new.append(req)
        busy.wake.set()

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
            self._busy_loop.aborts.add(request_id)
            compiling = self._compiling.pop(request_id, None)
            if compiling is not None:
                compiling.cancel()
            if self._busy_loop.wake is not None:
                self._busy_loop.wake.set()

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict:
        return {**self.client.stats(), "num_streams": len(self._slots), "tokens_per_s": self.router.tokens_per_s(),
                "total_output_tokens": self.router.tokens_out, "uptime_s": time.monotonic() - self._started_at,
                "errored": self.errored}
