"""UniProcExecutor: one worker, run on one dedicated thread of this process.

The thread owns the model (torch releases the GIL inside its kernels), so the caller's thread (the
async engine's event loop) stays free while a step computes. Steps and control calls share the
thread's queue, so they run in the order they were given.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from asyncengine.config import EngineConfig
from asyncengine.contracts.sched_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.errors import EngineDeadError
from asyncengine.executor.abstract import Executor
from asyncengine.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model_info, loaded=None) -> None:
        super().__init__(config, model_info, loaded)
        if config.world_size != 1:
            raise ValueError("the 'uni' executor runs one worker: use 'mp' or 'ray' for tensor_parallel_size "
                             "or pipeline_parallel_size > 1")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncengine-model")
        self._closed = False
        self.worker = Worker(config, eos_token_ids=self.eos_token_ids, loaded=loaded)
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def execute_model(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        return self._submit(self.worker.execute_model, scheduler_output)

    def _submit(self, fn, *args, **kwargs) -> Future:
        try:
            return self._pool.submit(fn, *args, **kwargs)
        except RuntimeError:  # the pool is shut down
            raise EngineDeadError("the executor was shut down") from None

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None, non_block=False):
        fn = getattr(self.worker, method) if isinstance(method, str) else (lambda *a, **k: method(self.worker, *a, **k))
        inner = self._submit(fn, *args, **(kwargs or {}))
        out: Future = Future()

        def done(f: Future) -> None:
            if f.cancelled():
                out.cancel()
            elif f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result([f.result()])
        inner.add_done_callback(done)
        return out if non_block else out.result(timeout)

    def check_health(self) -> None:
        if self._closed:
            raise EngineDeadError("the executor was shut down")

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.submit(self.worker.shutdown)  # after the steps queued (flushes KV writes)
            self._pool.shutdown(wait=True)
