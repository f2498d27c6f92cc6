"""Which executor runs the model: ``EngineConfig.distributed_executor_backend``. Apart from
abstract.py, so the interface does not import the implementations that import it."""
from __future__ import annotations

from asyncengine.config import EngineConfig
from asyncengine.executor.abstract import Executor


def executor_class(config: EngineConfig) -> type[Executor]:
    backend = config.distributed_executor_backend
    if backend == "uni":
        from asyncengine.executor.uniproc import UniProcExecutor  # lazy: only the chosen executor's dependencies (multiprocessing, ray) load
        return UniProcExecutor
    if backend == "mp":
        from asyncengine.executor.multiproc import MultiprocExecutor  # lazy: only the chosen executor's dependencies (multiprocessing, ray) load
        return MultiprocExecutor
    if backend == "ray":
        from asyncengine.executor.ray_executor import RayExecutor  # lazy: only the chosen executor's dependencies (multiprocessing, ray) load
        return RayExecutor
    raise ValueError(f"unknown distributed_executor_backend {backend!r}")
