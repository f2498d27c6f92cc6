"""Engine cores in their own processes, and the in-process client that talks to them.

``EngineCoreClient`` starts one engine-core process (an :class:`EngineCore` with its own busy
loop, scheduler, KV cache and executor, itself possibly tensor parallel) and exchanges msgspec
messages with it over a pipe: requests and aborts in, each step's ``EngineCoreOutput``s (with the
core's load) out.

Start-up overlaps: a core process starts with the config alone and imports torch and the model
code (seconds) while the front end, which imports no torch, reads the model's config and builds
its tokenizer; the front end then sends what it read (``StartCore``), and the core loads the
weights and reports ``CoreReady``.

``DPEngineCores`` puts ``data_parallel_size`` of them behind one front end: it routes each new
request to the core that holds its prompt's prefix unless that one is much busier, else to the
least loaded core (waiting + running, as last reported, plus what was sent since;
engine/dp_router.py), sends each abort to the core that owns the request, and aggregates stats
(labelled per core). The async engine's event loop stays in the front-end process. With the
``ray`` backend the cores are Ray actors instead of local processes (engine/ray_cores.py).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections import deque
from typing import Callable, Union

import msgspec

from asyncengine.config import EngineConfig
from asyncengine.core.request import Request
from asyncengine.core.sched_output import EngineCoreOutput
from asyncengine.engine import gc_policy
from asyncengine.engine.dp_health import DEAD_LOAD, CoreHealth, requests_of
from asyncengine.engine.dp_router import PrefixAffinityRouter
from asyncengine.errors import ConfigError, EngineDeadError, ModelLoadError
from asyncengine.models.model_info import ModelInfo
from asyncengine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

STATS_EVERY_S = 0.1  # a core pushes its full stats at most this often (its load: every step)
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

    @classmethod
    def of(cls, r: Request) -> "EngineCoreRequest":
        return cls(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, sampling_params=r.sampling_params,
                   eos_token_ids=sorted(r.eos_token_ids), max_tokens=r.max_tokens, priority=r.priority,
                   arrival_time=r.arrival_time, cache_salt=r.cache_salt, bad_words_token_ids=r.bad_words_token_ids)

    def to_request(self) -> Request:
        return Request(request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
                       sampling_params=self.sampling_params, eos_token_ids=frozenset(self.eos_token_ids),
                       max_tokens=self.max_tokens, priority=self.priority, arrival_time=self.arrival_time,
                       cache_salt=self.cache_salt, bad_words_token_ids=self.bad_words_token_ids)


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


class CoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    num_running: int
    num_waiting: int
    stats: dict | None = None


class CoreDead(msgspec.Struct, tag="dead"):
    message: str
    traceback: str
    error_type: str = ""  # the exception's class name; the front end re-raises ours by type


_START_ERRORS = {"ConfigError": ConfigError, "ModelLoadError": ModelLoadError}


def _dead(e: BaseException) -> CoreDead:
    return CoreDead(message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(),
                    error_type=type(e).__name__)


ToCore = Union[StartCore, AddRequest, Abort, AbortAll, ShutdownCore]
FromCore = Union[CoreReady, CoreOutputs, CoreDead]
_enc = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


# ---------------------------------------------------------------------------------- the core process


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def engine_core_main(config: EngineConfig, conn, parent_pid: int | None) -> None:
    """One engine core: import the engine (torch) at once, then wait for ``StartCore`` (the model
    info the front end read meanwhile), load, and run the busy loop: take inputs from the pipe,
    keep up to two steps in flight in the executor, send each finished step's outputs back.
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
        with gc_policy.paused(config.freeze_gc_after_load):
            from asyncengine.core.engine_core import EngineCore  # torch and the model code: the long part

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
    except BaseException as e:
        send(_dead(e))
        os._exit(1)
    send(CoreReady(pid=os.getpid(), num_blocks=core.num_blocks, max_model_len=core.max_model_len, dtype=core.dtype,
                   kernels=core.kernels))
    depth = 2 if config.async_scheduling else 1
    inflight: deque = deque()
    last_stats = 0.0
    reported_idle = True  # the front end has this core's load and stats as of its last idle moment
    try:
        while True:
            # inputs: block only when there is nothing to compute
            idle = not inflight and not core.has_unfinished()
            while conn.poll(1.0 if idle else 0):
                msg = _to_core.decode(conn.recv_bytes())
                if isinstance(msg, AddRequest):
                    core.add_request(msg.request.to_request())
                elif isinstance(msg, Abort):
                    core.abort_requests(msg.request_ids)
                elif isinstance(msg, AbortAll):
                    core.abort_all()
                else:
                    core.shutdown()
                    conn.close()
                    os._exit(0)
                idle = False
            if not inflight and not core.has_unfinished() and not reported_idle:
                # idle without a last step (an abort emptied it): the front end still needs the
                # final load and stats
                send(CoreOutputs(outputs=[], num_running=core.num_running, num_waiting=core.num_waiting,
                                 stats=core.stats()))
                reported_idle, last_stats = True, time.monotonic()
            if idle:
                core.check_health()
                continue
            while len(inflight) < depth and core.has_unfinished():
                so = core.schedule()
                if so.is_empty and not so.finished_req_ids:
                    break
                inflight.append((so, core.execute_model(so)))
                if so.is_empty:
                    break
            if not inflight:
                continue
            so, fut = inflight.popleft()
            outs = core.update(so, fut.result())
            if len(inflight) < depth and core.has_unfinished():  # queue the next step first
                nxt = core.schedule()
                if not nxt.is_empty or nxt.finished_req_ids:
                    inflight.append((nxt, core.execute_model(nxt)))
            now = time.monotonic()
            stats = None
            if now - last_stats >= STATS_EVERY_S or not (inflight or core.has_unfinished()):
                stats, last_stats = core.stats(), now
            send(CoreOutputs(outputs=outs, num_running=core.num_running, num_waiting=core.num_waiting, stats=stats))
            reported_idle = stats is not None and not (inflight or core.has_unfinished())
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


# ---------------------------------------------------------------------------------- the client


class EngineCoreClient:
    """One engine-core process, seen from the front end. ``sink(index, message)`` receives, on a
    reader thread, each CoreOutputs and, once, a CoreDead when the core fails or vanishes."""

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
                if not self._closing:
                    self._sink(self.index, CoreDead(
                        message=f"engine core {self.index} (pid {self.proc.pid}) is gone "
                                f"(exit code {self.proc.exitcode})", traceback=""))
                return
            if isinstance(msg, CoreOutputs):
                self.num_running, self.num_waiting = msg.num_running, msg.num_waiting
                self.sent_since_report = 0
                if msg.stats is not None:
                    self.stats = msg.stats
            self._sink(self.index, msg)
            if isinstance(msg, CoreDead):
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


class DPEngineCores:
    """``data_parallel_size`` engine-core processes behind one front end (the async engine).

    ``load_info()`` reads the model (models/model_info.py) in this process; it runs after the cores
    are launched, while they import torch."""

    def __init__(self, config: EngineConfig, load_info: Callable[[], ModelInfo]) -> None:
        import dataclasses

        self.config = config
        self._sink: Callable = lambda i, m: None
        # each core (and each of its TP ranks) gets its share of the cores unless told otherwise
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // (config.data_parallel_size
                                                                          * config.tensor_parallel_size))
        core_cfg = dataclasses.replace(config, data_parallel_size=1, engine_core_process=False, num_threads=threads)
        self.clients: list[EngineCoreClient] = []
        self._ray = None
        make = EngineCoreClient
        try:
            if config.distributed_executor_backend == "ray":  # the cores as Ray actors, on any node
                from asyncengine.engine.ray_cores import RayEngineCores

                self._ray = RayEngineCores(config)
                core_cfg, make = self._ray.core_config, self._ray.client
            for i in range(config.data_parallel_size):  # launch them all, then wait: they load in parallel
                self.clients.append(make(core_cfg, i, self._deliver))
            self.model_info = load_info()
            info = CoreModelInfo.of(self.model_info)
            for c in self.clients:
                c.start(info)
            readies = [c.wait_ready() for c in self.clients]
        except BaseException:
            self.shutdown()
            raise
        self.dtype = readies[0].dtype
        self.kernels = readies[0].kernels
        self.num_blocks = min(r.num_blocks for r in readies)
        self.max_model_len = min(r.max_model_len for r in readies)
        self.owner: dict[str, int] = {}  # user request id -> core index
        # a core may run this many more requests than the least loaded one and still get a
        # request whose prompt prefix it holds (engine/dp_router.py)
        self.router = PrefixAffinityRouter(len(self.clients), config.block_size,
                                           slack=max(2, config.max_num_seqs // 8))
        # a dead core fails only its own requests; the others go on (engine/dp_health.py)
        self.health = CoreHealth(len(self.clients))
        self._core_cfg, self._make, self._info = core_cfg, make, info

    # the same face as EngineCore where the front end needs it
    @property
    def tokenizer(self):
        return self.model_info.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.model_info.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return self.model_info.eos_token_ids

    @property
    def num_waiting(self) -> int:
        return sum(c.num_waiting + c.sent_since_report for c in self.clients)

    @property
    def num_running(self) -> int:
        return sum(c.num_running for c in self.clients)

    def set_sink(self, sink: Callable) -> None:
        """``sink(core index, CoreOutputs | CoreDead)``, called on the clients' reader threads."""
        self._sink = sink

    def _deliver(self, index: int, msg) -> None:
        self._sink(index, msg)

    def add_request(self, req: Request) -> int:
        """Send to the core that holds the prompt's prefix if it is not much busier, else to the
        least loaded core; returns its index."""
        loads = self.health.loads([c.load for c in self.clients])
        while min(loads) < DEAD_LOAD:
            i = self.router.pick(req.prompt_token_ids, req.cache_salt, loads)
            try:
                self.clients[i].add_request(req)
            except EngineDeadError:  # it died just now (its reader reports it): try another
                loads[i] = DEAD_LOAD
                continue
            self.owner[req.request_id] = i
            return i
        raise EngineDeadError("every engine core is dead")

    def abort_requests(self, ids) -> None:
        by_core: dict[int, list[str]] = {}
        for rid in ids:
            i = self.owner.pop(rid, None)
            if i is None and "#" in rid:  # one sample of an n > 1 request: its parent's core
                i = self.owner.get(rid.rsplit("#", 1)[0])
            if i is not None:
                by_core.setdefault(i, []).append(rid)
        for i, rids in by_core.items():
            if self.health.is_alive(i):  # a dead core's requests are already gone
                self.clients[i].abort_requests(rids)

    def core_died(self, index: int) -> list[str] | None:
        """Core ``index`` is gone: the ids of the requests it held (now failed), or None when no
        core is left (the engine is dead). With ``restart_dead_cores`` a fresh core replaces it."""
        if self.health.mark_dead(index):
            self.router.seen[index].clear()
            if getattr(self.config, "restart_dead_cores", False) and self.health.num_alive > 0:
                self._restart(index)
        lost = requests_of(self.owner, index)
        return lost if self.health.num_alive > 0 else None

    def _restart(self, index: int) -> None:
        """A new process for core ``index`` (it loads the model: seconds), on a thread; the core
        counts as alive again once it is ready."""
        def run() -> None:
            try:
                self.clients[index].shutdown(timeout=1.0)
                c = self._make(self._core_cfg, index, self._deliver)
                c.start(self._info)
                c.wait_ready()
            except Exception:
                log.exception("engine core %d could not be restarted", index)
                return
            self.clients[index] = c
            self.health.mark_alive(index)
            log.warning("engine core %d restarted (pid %s)", index, c.proc.pid)

        threading.Thread(target=run, daemon=True, name=f"asyncengine-core-{index}-restart").start()

    def finished(self, request_id: str) -> None:
        self.owner.pop(request_id, None)

    def abort_all(self) -> None:
        self.owner.clear()
        for c in self.clients:
            try:
                c.abort_all()
            except EngineDeadError:
                pass

    def check_health(self) -> None:
        """Raises once no core is left; a single dead core is reported by its reader thread."""
        if all(not c.is_alive() for c in self.clients):
            c = self.clients[0]
            raise EngineDeadError(f"every engine core is dead (core 0: pid {c.proc.pid}, exit code {c.proc.exitcode})")

    def stats(self) -> dict:
        """Sums over the cores (means for rates), plus each core's own under "cores"."""
        per = [dict(c.stats, num_running=c.num_running, num_waiting=c.num_waiting) for c in self.clients]
        out: dict = {}
        for s in per:
            for k, v in s.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
        for k in ("kv_usage", "prefix_cache_hit_rate", "mean_scheduled_tokens_per_step", "mean_queue_time_s"):
            if k in out:
                out[k] /= len(per)
        if out.get("spec_num_draft_tokens"):  # rates from the summed counts, not a mean of means
            out["spec_acceptance_rate"] = out["spec_num_accepted_tokens"] / out["spec_num_draft_tokens"]
            out["spec_mean_accepted_length"] = 1 + out["spec_num_accepted_tokens"] / out["spec_num_drafts"]
        out["num_kv_blocks"] = sum(s.get("num_kv_blocks", self.num_blocks) for s in per)
        out["data_parallel_size"] = len(per)
        out["dp_prefix_affinity_routed"] = self.router.num_affinity_routed
        out["cores"] = per
        out["cores_alive"] = self.health.num_alive
        return out

    def shutdown(self) -> None:
        for c in self.clients:
            c.shutdown()
        if self._ray is not None:
            self._ray.shutdown()
