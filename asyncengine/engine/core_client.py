"""The front end's one view of the engine core, wherever it runs: a ``CoreClient``.

The async engine talks only to this interface (add, abort, outputs, health, stats, shutdown) and
never sees a SchedulerOutput: the stepping is the core's own (``EngineCore``'s step pipeline,
engine_core/core.py).

- :class:`InprocClient`: the core in this process. ``get_output()`` runs one turn of the core's
  step pipeline, awaiting the oldest batch's future on the event loop (the model runs on the
  executor's thread or processes), so the loop never blocks; the front end's new inputs join
  before the next batches are scheduled.
- :class:`MPClient`: ``data_parallel_size`` engine cores (or one, with ``engine_core_process``),
  each in its own process (engine_core/core_proc.py) or Ray actor (engine_core/ray_cores.py), stepping on
  their own; ``get_output()`` hands over what their reader threads received. It routes each new
  request to the core that holds its prompt's prefix unless that one is much busier, else to the
  least loaded core (engine/dp_router.py), sends each abort to the core that owns the request, and
  aggregates stats (labelled per core). This process then imports no torch.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable

from asyncengine.config import EngineConfig
from asyncengine.core.request import Request
from asyncengine.contracts.sched_output import EngineCoreOutputs
from asyncengine.engine_core.core_proc import CoreDead, CoreModelInfo, EngineCoreProc
from asyncengine.engine_core.core_stats import combine
from asyncengine.engine.client_controls import InprocControls, MPControls
from asyncengine.engine.dp_health import DEAD_LOAD, CoreHealth, requests_of
from asyncengine.engine.dp_router import PrefixAffinityRouter
from asyncengine.errors import ConfigError, EngineDeadError
from asyncengine.models.model_info import ModelInfo

if TYPE_CHECKING:
    from asyncengine.engine_core.core import EngineCore

log = logging.getLogger(__name__)


class CoreClient(ABC):
    """What the front end may ask of the engine core(s). ``model_info``, ``max_model_len``,
    ``num_blocks`` and ``dtype`` are set by the implementations."""

    model_info: ModelInfo
    max_model_len: int
    num_blocks: int
    dtype: str
    kernels: str = ""  # the dtype and why, the kernels in use (worker/kernel_info.py)
    # where a P/D prefill core serves its transfers (tcp), as decode cores reach it; None: nowhere
    kv_transfer_address: str | None = None
    core: "EngineCore | None" = None  # the core itself when it runs in this process (introspection)

    @staticmethod
    def make(config: EngineConfig, core: "EngineCore | None" = None) -> "CoreClient":
        """``core``: an engine core already built in this process (tests share one)."""
        if config.prefill_cores or config.decode_cores:  # never silently colocated

            raise ConfigError("prefill_cores/decode_cores run through AsyncLLMEngine.from_config (a PDEngine: "
                              "engine/pd_client.py, docs/kv_connector.md) or `asyncengine serve --prefill-cores`; "
                              "AsyncLLMEngine(config) does not take them")
        if core is None and (config.data_parallel_size > 1 or config.engine_core_process):
            from asyncengine.models.model_info import load_model_info  # lazy: the front end imports no torch: core code loads only where it runs here

            # the cores import torch while this process reads the model's config and tokenizer
            return MPClient(config, lambda: load_model_info(config.model_config))
        if core is None:
            from asyncengine.engine_core.core import EngineCore  # lazy: the front end imports no torch: core code loads only where it runs here

            core = EngineCore(config)
        return InprocClient(core)

    @property
    def tokenizer(self):
        return self.model_info.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.model_info.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return self.model_info.eos_token_ids

    def bind(self, wake: Callable[[], None], pump: Callable[[], None]) -> None:
        """``wake()``: tell the front end's loop there may be output (safe from any thread);
        ``pump()``: hand the front end's pending inputs over now (called on the loop)."""

    @property
    @abstractmethod
    def num_waiting(self) -> int:
        """Requests (samples) waiting to be scheduled, for admission control."""

    @property
    @abstractmethod
    def num_running(self) -> int:
        """Requests (samples) being computed."""

    @abstractmethod
    def add_request(self, req: Request) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids) -> None: ...

    @abstractmethod
    def abort_all(self) -> None:
        """Abandon every request (the front end's loop went away)."""

    def request_finished(self, request_id: str) -> None:
        """The front end saw the request's last output."""

    @abstractmethod
    async def get_output(self) -> EngineCoreOutputs | None:
        """The next finished batch's outputs, or None at once when there is none to wait for
        (then the front end waits for ``wake`` or an input)."""

    @abstractmethod
    def is_idle(self) -> bool:
        """Nothing of the front end's is left to compute here (the drained shutdown may end)."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise EngineDeadError if the core (or a worker of it) is gone."""

    @abstractmethod
    def stats(self) -> dict: ...

    def cores_alive(self) -> tuple[int, int]:
        """(engine cores alive, engine cores): below the second, the engine serves degraded."""
        return 1, 1

    # a trainer's controls (update_weights, reset_prefix_cache, ...): engine/client_controls.py

    @abstractmethod
    def shutdown(self) -> None:
        """Stop everything the client started (idempotent)."""


async def _wait(fut: Future) -> None:
    """Await a concurrent future on the running loop without ever cancelling it (a batch handed to
    the executor runs to its end; its result is folded in or dropped by the core)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def done(_f) -> None:
        try:
            loop.call_soon_threadsafe(lambda: waiter.done() or waiter.set_result(None))
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass
    fut.add_done_callback(done)
    await waiter


class InprocClient(InprocControls, CoreClient):
    """The engine core in this process, stepped by the front end's busy loop."""

    def __init__(self, core: "EngineCore") -> None:
        self.core = core
        self.model_info = core.model_info
        self.max_model_len = core.max_model_len
        self.num_blocks = core.num_blocks
        self.dtype = core.dtype
        self.kernels = core.kernels
        self.kv_transfer_address = core.kv_transfer_address
        self._pump: Callable[[], None] = lambda: None

    def bind(self, wake, pump) -> None:
        self._pump = pump

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting

    @property
    def num_running(self) -> int:
        return self.core.num_running

    def add_request(self, req: Request) -> None:
        self.core.add_request(req)

    def abort_requests(self, request_ids) -> None:
        self.core.abort_requests(request_ids)

    def abort_all(self) -> None:
        self.core.abort_all()

    async def get_output(self) -> EngineCoreOutputs | None:
        core = self.core
        if not core.has_work():
            return None
        core.fill_batch_queue()
        fut = core.oldest_batch()
        if fut is None:  # work exists but none is schedulable now: wait for an input
            return None
        await _wait(fut)
        self._pump()  # inputs that arrived meanwhile join the batches scheduled next
        return core.finish_oldest_batch()

    def is_idle(self) -> bool:
        return not self.core.has_work()

    def check_health(self) -> None:
        self.core.check_health()

    def stats(self) -> dict:
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.shutdown()


class MPClient(MPControls, CoreClient):
    """``data_parallel_size`` engine-core processes (or Ray actors) behind one front end.

    ``load_info()`` reads the model (models/model_info.py) in this process; it runs after the cores
    are launched, while they import torch."""

    def __init__(self, config: EngineConfig, load_info: Callable[[], ModelInfo]) -> None:
        import dataclasses

        self.config = config
        self._inbox: deque = deque()  # (core index, message), from the cores' reader threads
        self._wake: Callable[[], None] = lambda: None
        # each core (and each of its TP ranks) gets its share of the cores unless told otherwise
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // (config.data_parallel_size
                                                                          * config.world_size))
        core_cfg = dataclasses.replace(config, data_parallel_size=1, engine_core_process=False, num_threads=threads)
        self.clients: list[EngineCoreProc] = []
        self._ray = None
        make = EngineCoreProc
        try:
            if config.distributed_executor_backend == "ray":  # the cores as Ray actors, on any node
                from asyncengine.engine_core.ray_cores import RayEngineCores  # lazy: the front end imports no torch: core code loads only where it runs here

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
        self.kv_transfer_address = self.clients[0].kv_transfer_address  # (a P/D core is one core)
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

    @property
    def num_waiting(self) -> int:
        return sum(c.num_waiting + c.sent_since_report for c in self.clients)

    @property
    def num_running(self) -> int:
        return sum(c.num_running for c in self.clients)

    def bind(self, wake, pump) -> None:
        self._wake = wake
        if self._inbox:
            wake()

    def _deliver(self, index: int, msg) -> None:  # on a reader thread: hand over, wake the loop
        self._inbox.append((index, msg))
        self._wake()

    async def get_output(self) -> EngineCoreOutputs | None:
        if not self._inbox:
            return None
        index, msg = self._inbox.popleft()
        if isinstance(msg, CoreDead):  # its requests fail, or the engine dies (the traceback: log only)
            log.error("engine core %d died: %s%s", index, msg.message, f"\n{msg.traceback}" if msg.traceback else "")
            lost = self.core_died(index)
            if lost is None:
                raise EngineDeadError(msg.message)
            return EngineCoreOutputs(outputs=[], num_running=self.num_running, num_waiting=0, lost_req_ids=lost,
                                     lost_reason=f"engine core {index} died ({msg.message})")
        return msg

    def is_idle(self) -> bool:
        return True  # the cores step on their own; the front end waits for its streams

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
            if self.config.restart_dead_cores and self.health.num_alive > 0:
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

    def request_finished(self, request_id: str) -> None:
        self.owner.pop(request_id, None)

    def abort_all(self) -> None:
        self.owner.clear()
        for c in self.clients:
            try:
                c.abort_all()
            except EngineDeadError:
                pass

    def cores_alive(self) -> tuple[int, int]:
        return self.health.num_alive, self.health.num_cores

    def check_health(self) -> None:
        """Raises once no core is left; a single dead core is reported by its reader thread."""
        if all(not c.is_alive() for c in self.clients):
            c = self.clients[0]
            raise EngineDeadError(f"every engine core is dead (core 0: pid {c.proc.pid}, exit code {c.proc.exitcode})")

    def stats(self) -> dict:
        """Sums over the cores (means for rates), plus each core's own under "cores"."""
        per = [dict(c.stats, num_running=c.num_running, num_waiting=c.num_waiting) for c in self.clients]
        out = combine(per)
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
