"""An engine core in its own process: the wire messages, the process's main loop, and the handle
the front end's client holds for it.

The process runs an :class:`~asyncengine.engine_core.core.EngineCore` and its step pipeline (the same
in-flight batch queue every driver runs) and exchanges msgspec messages with the front end over a
pipe (or, for a Ray actor, a socket): requests and aborts in, each finished batch's
``EngineCoreOutputs`` (with the core's load) out.

Start-up overlaps: a core process starts with the config alone and imports torch and the model
code (seconds) while the front end, which imports no torch, reads the model's config and builds
its tokenizer; the front end then sends what it read (``StartCore``), and the core loads the
weights and reports ``CoreReady``.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from concurrent.futures import Future, wait
from typing import Callable, Union

import msgspec

from asyncengine.config import EngineConfig
from asyncengine.core.request import Request
from asyncengine.contracts.multimodal import MultiModalInput
from asyncengine.contracts.sched_output import EngineCoreOutputs
from asyncengine.engine_core import gc_policy
from asyncengine.engine_core.core_control import Control, ControlResult, PendingCalls, run_control
from asyncengine.errors import ConfigError, EngineDeadError, ModelLoadError
from asyncengine.lora_request import LoRARequest
from asyncengine.models.model_info import ModelInfo
from asyncengine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

STATS_EVERY_S = 0.1  # a core pushes its full stats at most this often (its load: every batch)
READY_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------------------- messages


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    """A validated request, as the front end's input processor made it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int
    priority: int
    arrival_time: float  # time.monotonic(): one clock for every process on the machine
    cache_salt: str | None = None
    bad_words_token_ids: list[list[int]] | None = None
    kv_transfer_params: dict[str, str] | None = None
    lora_request: LoRARequest | None = None
    mm_inputs: list[MultiModalInput] | None = None

    @classmethod
    def of(cls, r: Request) -> "EngineCoreRequest":
        return cls(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, sampling_params=r.sampling_params,
                   eos_token_ids=sorted(r.eos_token_ids), max_tokens=r.max_tokens, priority=r.priority,
                   arrival_time=r.arrival_time, cache_salt=r.cache_salt, bad_words_token_ids=r.bad_words_token_ids,
                   kv_transfer_params=r.kv_transfer_params, lora_request=r.lora_request,
                   mm_inputs=r.mm_inputs)

    def to_request(self) -> Request:
        return Request(request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
                       sampling_params=self.sampling_params, eos_token_ids=frozenset(self.eos_token_ids),
                       max_tokens=self.max_tokens, priority=self.priority, arrival_time=self.arrival_time,
                       cache_salt=self.cache_salt, bad_words_token_ids=self.bad_words_token_ids,
                       kv_transfer_params=self.kv_transfer_params, lora_request=self.lora_request,
                       mm_inputs=self.mm_inputs)


class CoreModelInfo(msgspec.Struct):
    """What the front end read of the model (models/model_info.py), so that a core reads no
    tokenizer and, for a checkpoint folder, imports no transformers (seconds saved)."""

    hf_config: dict
    eos_token_ids: list[int]
    max_model_len: int
    vocab_size: int
    path: str
    generation_config: dict | None = None

    @classmethod
    def of(cls, info: ModelInfo) -> "CoreModelInfo":
        to_dict = getattr(info.hf_config, "to_dict", None)
        return cls(hf_config=to_dict() if to_dict else dict(vars(info.hf_config)),
                   eos_token_ids=list(info.eos_token_ids), max_model_len=info.max_model_len,
                   vocab_size=info.vocab_size, path=info.path, generation_config=info.generation_config)

    def to_model_info(self) -> ModelInfo:
        import types

        return ModelInfo(hf_config=types.SimpleNamespace(**self.hf_config), tokenizer=None,
                         eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
                         vocab_size=self.vocab_size, path=self.path, generation_config=self.generation_config)


class StartCore(msgspec.Struct, tag="start"):
    """The first message to a core: load this model and report ready."""

    info: CoreModelInfo


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class AbortAll(msgspec.Struct, tag="abort_all"):
    pass


class ShutdownCore(msgspec.Struct, tag="shutdown"):
    pass


class CoreReady(msgspec.Struct, tag="ready"):
    pid: int
    num_blocks: int
    max_model_len: int
    dtype: str  # the resolved dtype ("float32", ...), which only the core's torch knows
    kernels: str = ""  # the dtype and why, the kernels in use (worker/kernel_info.py)
    kv_transfer_address: str | None = None  # a P/D prefill core's transfer server, as bound (tcp)


class CoreDead(msgspec.Struct, tag="dead"):
    message: str
    traceback: str
    error_type: str = ""  # the exception's class name; the front end re-raises ours by type


_START_ERRORS = {"ConfigError": ConfigError, "ModelLoadError": ModelLoadError}


def _dead(e: BaseException) -> CoreDead:
    return CoreDead(message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(),
                    error_type=type(e).__name__)


ToCore = Union[StartCore, AddRequest, Abort, AbortAll, ShutdownCore, Control]
FromCore = Union[CoreReady, EngineCoreOutputs, CoreDead, ControlResult]
_enc = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


# ---------------------------------------------------------------------------------- the core process


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def _load_core(config: EngineConfig, conn):
    """Import the engine (torch) at once, then wait for ``StartCore`` (the model info the front end
    read meanwhile) and load. Exits quietly if the front end gives up first."""
    with gc_policy.paused(config.freeze_gc_after_load):
        from asyncengine.engine_core.core import EngineCore  # lazy: torch and the model code: the long part

        try:
            start = _to_core.decode(conn.recv_bytes())
        except (EOFError, OSError):  # the front end is gone
            os._exit(0)
        if not isinstance(start, StartCore):  # the front end gave up before the model was read
            conn.close()
            os._exit(0)
        core = EngineCore(config, info=start.info.to_model_info())
    if config.freeze_gc_after_load:
        gc_policy.freeze_after_load()
    return core


def engine_core_main(config: EngineConfig, conn, parent_pid: int | None) -> None:
    """One engine core: load (``_load_core``), then loop: take the inputs from the pipe (blocking
    only when there is nothing to compute), run one turn of the core's step pipeline
    (``EngineCore.step_with_batch_queue``), send the finished batch's outputs back.
    ``conn``: a multiprocessing Connection (a pipe, or a socket for a core that runs as a Ray
    actor); ``parent_pid`` None: nothing to watch (a Ray actor dies with its owner, and at the
    connection's end)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()

    def send(msg) -> None:
        conn.send_bytes(_enc.encode(msg))

    try:
        core = _load_core(config, conn)
    except BaseException as e:
        send(_dead(e))
        os._exit(1)
    send(CoreReady(pid=os.getpid(), num_blocks=core.num_blocks, max_model_len=core.max_model_len, dtype=core.dtype,
                   kernels=core.kernels, kv_transfer_address=core.kv_transfer_address))
    last_stats = 0.0
    reported_idle = True  # the front end has this core's load and stats as of its last idle moment
    stuck = False  # work exists but nothing could be scheduled: wait a little for an input
    try:
        while True:
            idle = not core.has_work()
            while conn.poll(1.0 if idle else 0.01 if stuck else 0):
                msg = _to_core.decode(conn.recv_bytes())
                if isinstance(msg, AddRequest):
                    core.add_request(msg.request.to_request())
                elif isinstance(msg, Abort):
                    core.abort_requests(msg.request_ids)
                elif isinstance(msg, AbortAll):
                    core.abort_all()
                elif isinstance(msg, Control):  # a trainer's call (engine_core/core_control.py)
                    result = run_control(core, msg)
                    while msg.method == "pause_scheduling" and core.oldest_batch() is not None:
                        wait([core.oldest_batch()])
                        send(core.finish_oldest_batch(refill=False))
                    send(result)
                else:
                    core.shutdown()
                    conn.close()
                    os._exit(0)
                idle = False
            batch = core.step_with_batch_queue() if core.has_work() else None
            stuck = batch is None and core.has_work()
            now = time.monotonic()
            if batch is None:
                if not reported_idle:  # idle without a last batch (an abort emptied it): the front
                    batch = core.take_outputs()  # end still needs the final load and stats
                else:
                    if idle:
                        core.check_health()
                    continue
            quiet = not core.has_work()
            if quiet or now - last_stats >= STATS_EVERY_S:
                batch.stats, last_stats = core.stats(), now
            send(batch)
            reported_idle = quiet and batch.stats is not None
    except (EOFError, OSError):  # the front end is gone
        core.shutdown()
        os._exit(0)
    except BaseException as e:
        try:
            send(_dead(e))
        except Exception:
            pass
        core.shutdown()
        os._exit(1)


# ---------------------------------------------------------------------------------- its handle


class EngineCoreProc:
    """One engine-core process, seen from the front end. ``sink(index, message)`` receives, on a
    reader thread, each EngineCoreOutputs and, once, a CoreDead when the core fails or vanishes."""

    def __init__(self, config: EngineConfig, index: int, sink: Callable) -> None:
        self.index = index
        self._sink = sink
        self.conn, self.proc = self._launch(config)
        self._lock = threading.Lock()
        self._closing = False
        self._started = False
        self.num_running = 0
        self.num_waiting = 0
        self.sent_since_report = 0
        self.stats: dict = {}
        self.ready: CoreReady | None = None
        self._reader: threading.Thread | None = None
        self._calls = PendingCalls()

    def _launch(self, config: EngineConfig):
        """Start the core process (it imports torch, then waits for ``start``); returns (its
        connection, a handle with multiprocessing.Process's pid, exitcode, is_alive, join and kill)."""
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe(duplex=True)
        # not daemonic: a core may start worker processes of its own (tensor parallel)
        proc = ctx.Process(target=engine_core_main, args=(config, child, os.getpid()),
                           name=f"asyncengine-core-{self.index}", daemon=False)
        proc.start()
        child.close()
        return conn, proc

    def start(self, info: CoreModelInfo) -> None:
        """Hand the core the model the front end read: it loads it and reports ready."""
        self._send(StartCore(info))
        self._started = True

    @property
    def kv_transfer_address(self) -> str | None:
        """Where this core serves its P/D transfers (a prefill core over tcp), as bound."""
        return self.ready.kv_transfer_address if self.ready is not None else None

    def wait_ready(self) -> CoreReady:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise EngineDeadError(f"engine core {self.index} exited during start-up (code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"engine core {self.index} did not start in {READY_TIMEOUT_S:.0f} s")
        msg = _from_core.decode(self.conn.recv_bytes())
        if isinstance(msg, CoreDead):
            if msg.error_type in _START_ERRORS:  # a bad config or checkpoint: the caller's error, as in-process
                raise _START_ERRORS[msg.error_type](msg.message.removeprefix(f"{msg.error_type}: "))
            raise EngineDeadError(f"engine core {self.index} failed to start: {msg.message}")
        self.ready = msg
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name=f"asyncengine-core-{self.index}-reader")
        self._reader.start()
        return msg

    def _read_loop(self) -> None:
        while True:
            try:
                msg = _from_core.decode(self.conn.recv_bytes())
            except (EOFError, OSError):
                self._calls.fail_all(f"engine core {self.index} is gone")
                if not self._closing:
                    self._sink(self.index, CoreDead(
                        message=f"engine core {self.index} (pid {self.proc.pid}) is gone "
                                f"(exit code {self.proc.exitcode})", traceback=""))
                return
            if isinstance(msg, ControlResult):
                self._calls.resolve(msg)
                continue
            if isinstance(msg, EngineCoreOutputs):
                self.num_running, self.num_waiting = msg.num_running, msg.num_waiting
                self.sent_since_report = 0
                if msg.stats is not None:
                    self.stats = msg.stats
            self._sink(self.index, msg)
            if isinstance(msg, CoreDead):
                self._calls.fail_all(f"engine core {self.index} died: {msg.message}")
                return

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting + self.sent_since_report

    def _send(self, msg) -> None:
        with self._lock:
            try:
                self.conn.send_bytes(_enc.encode(msg))
            except (OSError, ValueError):
                raise EngineDeadError(f"engine core {self.index} is gone") from None

    def add_request(self, req: Request) -> None:
        self.sent_since_report += req.sampling_params.n
        self._send(AddRequest(EngineCoreRequest.of(req)))

    def abort_requests(self, ids: list[str]) -> None:
        self._send(Abort(list(ids)))

    def abort_all(self) -> None:
        self._send(AbortAll())

    def call(self, method: str, *args) -> "Future":
        """A control call (engine_core/core_control.py METHODS) on the core: the future of its result."""
        msg, fut = self._calls.new(method, args)
        self._send(msg)
        return fut

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closing:
            return
        self._closing = True
        if not self._started:  # still importing, holding nothing: no need to wait for it
            self.proc.kill()
            self.proc.join(5)
            self.conn.close()
            return
        try:
            self._send(ShutdownCore())
        except EngineDeadError:
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
