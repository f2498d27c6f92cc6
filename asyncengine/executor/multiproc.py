"""MultiprocExecutor (``mp``): ``tensor_parallel_size x pipeline_parallel_size`` worker processes on
this machine.

Each rank is a spawned process with one :class:`~asyncengine.worker.worker.Worker`; the ranks form
a torch.distributed process group (gloo on CPU, NCCL on CUDA) for the Megatron collectives. Each
step's SchedulerOutput is encoded once (msgspec) and written to every rank's pipe (the transport
measured in docs/benchmarks.md); the output rank (tensor rank 0 of the last pipeline stage)
answers with the step's ModelRunnerOutput. The engine core's batches in flight are all queued in
the pipes at once, so with pipeline stages each works on a different batch.

Faults: a reader thread per rank and a monitor on the processes' sentinels turn a dead or failing
rank into EngineDeadError on every pending future within moments, and kill the other ranks (which
may be blocked in a collective). Workers ignore SIGINT (the parent shuts them down), exit when
their pipe closes, and watch their parent's pid, so no worker outlives the engine.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import traceback
import weakref
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import wait as wait_any

from asyncengine.config import EngineConfig
from asyncengine.contracts.sched_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.errors import EngineDeadError
from asyncengine.executor import messages as M
from asyncengine.executor.abstract import Executor

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0  # loading a large model can take minutes; a dead rank is noticed at once
_PARENT_POLL_S = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_threads_per_rank(world_size: int) -> int:
    """One share of the cores per rank: more would have the ranks fight for the same cores."""
    return max(1, (os.cpu_count() or 1) // world_size)


# ---------------------------------------------------------------------------------- worker side


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent is gone (re-parented), whatever this process is doing (even blocked
    in a collective)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(_PARENT_POLL_S)


def worker_main(config: EngineConfig, rank: int, world_size: int, init_method: str,
                eos_token_ids: list[int], hf_config: dict | None, conn, parent_pid: int) -> None:
    """A worker process: set up, then serve steps and control calls from the pipe until told to
    stop or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    from asyncengine.worker.worker import Worker  # lazy: the worker (torch, the models) loads in the process that runs it

    def send(msg) -> None:
        conn.send_bytes(M.encode(msg))

    def fail(e: BaseException, fatal: bool) -> None:
        try:
            send(M.Error(rank=rank, message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(),
                         fatal=fatal))
        except Exception:
            pass

    try:
        worker = Worker(config, rank=rank, world_size=world_size, distributed_init_method=init_method,
                        eos_token_ids=eos_token_ids, hf_config=hf_config)
        worker.init_device()
        worker.load_model()
        send(M.Ready(rank=rank, pid=os.getpid()))
    except BaseException as e:
        fail(e, fatal=True)
        os._exit(1)
    while True:
        try:
            msg = M.decode_request(conn.recv_bytes())
        except (EOFError, OSError):  # the parent closed the pipe or died
            os._exit(0)
        if isinstance(msg, M.ExecuteModel):
            try:
                out = worker.execute_model(msg.scheduler_output)
            except BaseException as e:
                # peers may be waiting in a collective this rank will never join: leave, so that
                # their process group fails them too, and the executor declares the engine dead
                fail(e, fatal=True)
                os._exit(1)
            if out is not None:
                send(M.StepResult(output=out))
        elif isinstance(msg, M.RPC):
            try:
                result = M.run_rpc(worker, msg)
            except BaseException as e:
                fail(e, fatal=False)
                continue
            import pickle

            send(M.RPCResult(payload=pickle.dumps(result)))
        else:  # Shutdown
            worker.shutdown()
            conn.close()
            os._exit(0)


# ---------------------------------------------------------------------------------- executor side


def _kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_info, loaded=None) -> None:
        super().__init__(config, model_info, loaded)
        if config.num_threads is None:
            import dataclasses

            config = dataclasses.replace(config, num_threads=default_threads_per_rank(config.world_size))
            self.config = config
        n = self.world_size = config.world_size
        self.output_rank = n - config.tensor_parallel_size
        self._dead: EngineDeadError | None = None
        self._closing = False
        self._lock = threading.Lock()  # guards sends and the pending queues
        self._pending: list[deque[Future]] = [deque() for _ in range(n)]
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs = []
        self.conns = []
        for rank in range(n):
            parent_end, child_end = ctx.Pipe(duplex=True)
            p = ctx.Process(target=worker_main, name=f"asyncengine-worker-{rank}",
                            args=(config, rank, n, init_method, self.eos_token_ids, self.hf_config_dict,
                                  child_end, os.getpid()),
                            daemon=True)
            p.start()
            child_end.close()
            self.procs.append(p)
            self.conns.append(parent_end)
        # the processes die with this object (or at exit) even if shutdown() is never called
        self._finalizer = weakref.finalize(self, _kill_all, list(self.procs))  # also runs at exit
        try:
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.pids = [p.pid for p in self.procs]
        self._readers = [threading.Thread(target=self._read_loop, args=(r,), daemon=True,
                                          name=f"asyncengine-mp-reader-{r}") for r in range(n)]
        for t in self._readers:
            t.start()
        self._monitor = threading.Thread(target=self._monitor_loop, daemon=True, name="asyncengine-mp-monitor")
        self._monitor.start()

    # ------------------------------------------------------------------ start-up

    def _wait_ready(self) -> None:
        waiting = set(range(self.world_size))
        deadline = time.monotonic() + READY_TIMEOUT_S
        by_conn = {id(c): r for r, c in enumerate(self.conns)}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineDeadError(f"worker ranks {sorted(waiting)} did not start in {READY_TIMEOUT_S:.0f} s")
            objs = [self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting]
            for obj in wait_any(objs, timeout=left):
                if isinstance(obj, int):  # a sentinel: a process exited; its pipe may hold why
                    r = next(r for r in waiting if self.procs[r].sentinel == obj)
                    if self.conns[r].poll(0.5):
                        continue
                    raise EngineDeadError(f"worker rank {r} exited during start-up "
                                          f"(exit code {self.procs[r].exitcode})")
                r = by_conn[id(obj)]
                if r not in waiting:
                    continue
                try:
                    msg = M.decode_reply(obj.recv_bytes())
                except (EOFError, OSError):
                    raise EngineDeadError(f"worker rank {r} exited during start-up "
                                          f"(exit code {self.procs[r].exitcode})") from None
                if isinstance(msg, M.Error):
                    raise EngineDeadError(f"worker rank {r} failed to start: {msg.message}\n{msg.traceback}")
                waiting.discard(r)

    # ------------------------------------------------------------------ background threads

    def _read_loop(self, rank: int) -> None:
        conn = self.conns[rank]
        while True:
            try:
                msg = M.decode_reply(conn.recv_bytes())
            except (EOFError, OSError):
                if not self._closing:
                    code = self.procs[rank].exitcode
                    self._die(f"worker rank {rank} (pid {self.procs[rank].pid}) is gone"
                              + (f" (exit code {code})" if code is not None else ""))
                return
            if isinstance(msg, M.Error) and (msg.fatal or not self._pending[rank]):
                self._die(f"worker rank {rank} failed: {msg.message}", msg.traceback)
                return
            with self._lock:
                fut = self._pending[rank].popleft() if self._pending[rank] else None
            if fut is None:
                continue
            if isinstance(msg, M.StepResult):
                fut.set_result(msg.output)
            elif isinstance(msg, M.RPCResult):
                import pickle

                fut.set_result(pickle.loads(msg.payload))
            elif isinstance(msg, M.Error):
                fut.set_exception(RuntimeError(f"worker rank {rank}: {msg.message}"))

    def _monitor_loop(self) -> None:
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while sentinels and not self._closing:
            ready = wait_any(list(sentinels), timeout=1.0)
            for s in ready:
                r = sentinels.pop(s)
                if not self._closing:
                    # let the reader deliver the rank's own last words (an Error) first
                    time.sleep(0.2)
                    self._die(f"worker rank {r} (pid {self.procs[r].pid}) exited with code {self.procs[r].exitcode}")
            if self._dead is not None:
                return

    def _die(self, why: str, tb: str | None = None) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = EngineDeadError(why)
            pending = [f for q in self._pending for f in q]
            for q in self._pending:
                q.clear()
        log.error("mp executor: %s%s", why, f"\n{tb}" if tb else "")
        for f in pending:
            if not f.done():
                f.set_exception(EngineDeadError(why))
        # the other ranks may be blocked in a collective with the dead one: end them all
        _kill_all(self.procs)

    # ------------------------------------------------------------------ the Executor interface

    def _send_all(self, data: bytes, futures: list[Future | None]) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            if self._closing:
                raise EngineDeadError("the executor was shut down")
            for r, f in enumerate(futures):
                if f is not None:
                    self._pending[r].append(f)
            try:
                for c in self.conns:
                    c.send_bytes(data)
            except (OSError, ValueError) as e:
                broken = e
            else:
                return
        self._die(f"a worker's pipe broke ({broken})")
        raise EngineDeadError(str(self._dead))

    def execute_model(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        fut: Future = Future()
        try:
            futures: list[Future | None] = [None] * self.world_size
            futures[self.output_rank] = fut
            self._send_all(M.encode(M.ExecuteModel(scheduler_output)), futures)
        except EngineDeadError as e:
            if not fut.done():
                fut.set_exception(e)
        return fut

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None, non_block=False):
        futs = [Future() for _ in range(self.world_size)]
        self._send_all(M.encode(M.make_rpc(method, tuple(args), kwargs)), futs)
        out: Future = Future()
        left = [self.world_size]
        lock = threading.Lock()

        def done(_f) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            errs = [f.exception() for f in futs if f.exception() is not None]
            if errs:
                out.set_exception(errs[0])
            else:
                out.set_result([f.result() for f in futs])
        for f in futs:
            f.add_done_callback(done)
        return out if non_block else out.result(timeout)

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if self._closing:
            raise EngineDeadError("the executor was shut down")
        for r, p in enumerate(self.procs):
            if not p.is_alive():
                self._die(f"worker rank {r} (pid {p.pid}) exited with code {p.exitcode}")
                raise EngineDeadError(str(self._dead))

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        data = M.encode(M.Shutdown())
        for c in self.conns:
            try:
                c.send_bytes(data)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        _kill_all(self.procs)
        with self._lock:
            pending = [f for q in self._pending for f in q]
            for q in self._pending:
                q.clear()
        for f in pending:
            if not f.done():
                f.set_exception(EngineDeadError("the executor was shut down"))
        for c in self.conns:
            c.close()
        self._finalizer()
