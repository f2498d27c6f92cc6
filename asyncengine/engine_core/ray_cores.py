"""Data-parallel engine cores as Ray actors (``data_parallel_size > 1`` with
``distributed_executor_backend="ray"``): the replicas go on any node of the Ray cluster.

Each core is one actor running the same ``engine_core_main`` busy loop as a local engine-core
process; only the wire differs: the actor listens on a TCP port of its node (a
``multiprocessing.connection`` listener, authenticated with a random key the driver hands it) and
the front end connects to it, so the same msgspec messages flow as over the local pipe, and the
same ``MPClient`` (engine/core_client.py) routes, aborts and aggregates. Placement: a placement group with one
bundle per core (strategy ``EngineConfig.ray_placement_strategy``; ``STRICT_SPREAD`` = one core
per node). With one rank (no tensor or pipeline parallelism) a core runs its model in the actor itself (``uni``, on
the bundle's CPUs); above 1 its ranks are Ray actors of their own (the ``ray`` executor, one
placement group per core) and the core actor reserves no CPU.

A core actor is owned by the driver: Ray ends it when the driver exits, and it exits when its
connection closes.
"""
from __future__ import annotations

import dataclasses
import os
import time

from asyncengine.config import EngineConfig
from asyncengine.engine_core.core_proc import EngineCoreProc, engine_core_main
from asyncengine.errors import EngineDeadError
from asyncengine.executor.ray_executor import acquire_ray, release_ray


class EngineCoreActor:
    """The actor body: a listener now, the engine core's busy loop once the driver connects."""

    def __init__(self, config: EngineConfig, authkey: bytes) -> None:
        from multiprocessing.connection import Listener

        self.config = config
        self.listener = Listener(("0.0.0.0", 0), authkey=authkey)

    def address(self) -> tuple[str, int, int, str]:
        """(node ip, port, pid, Ray node id)."""
        import ray

        return (ray.util.get_node_ip_address(), self.listener.address[1], os.getpid(),
                ray.get_runtime_context().get_node_id())

    def run(self) -> None:
        """Serve the driver's connection until told to stop or it closes (then the process exits)."""
        conn = self.listener.accept()
        self.listener.close()
        engine_core_main(self.config, conn, None)


class _ActorProcess:
    """A core actor seen through the part of multiprocessing.Process the client uses."""

    def __init__(self, ray, actor, run_ref, pid: int) -> None:
        self._ray, self._actor, self._run, self.pid = ray, actor, run_ref, pid

    def is_alive(self) -> bool:
        done, _ = self._ray.wait([self._run], timeout=0)
        return not done

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive() else 1

    def join(self, timeout: float | None = None) -> None:
        self._ray.wait([self._run], timeout=timeout)

    def kill(self) -> None:
        try:
            self._ray.kill(self._actor)
        except Exception:
            pass


class RayEngineCores:
    """The placement of ``data_parallel_size`` core actors, and the clients that start them."""

    def __init__(self, config: EngineConfig) -> None:
        ray, self._holds_ray = acquire_ray()
        self.ray = ray
        from ray.util.placement_group import placement_group

        self.config = config
        n = config.data_parallel_size
        cuda = config.torch_device.type == "cuda"
        if config.world_size == 1:  # the model runs in the core actor, on its bundle's CPUs (and GPU)
            threads = config.num_threads or 1
            self.core_config = dataclasses.replace(config, data_parallel_size=1, engine_core_process=False,
                                                   num_threads=threads, distributed_executor_backend="uni")
            self.bundle = {"CPU": threads, **({"GPU": 1} if cuda else {})}
        else:  # the core only schedules; its ranks are actors placed by its own executor
            self.core_config = dataclasses.replace(config, data_parallel_size=1, engine_core_process=False)
            self.bundle = None
        self.pg = None
        if self.bundle is not None:
            self.pg = placement_group([dict(self.bundle) for _ in range(n)], strategy=config.ray_placement_strategy)
            ready, _ = ray.wait([self.pg.ready()], timeout=config.distributed_timeout_s)
            if not ready:
                self.shutdown()
                raise EngineDeadError(
                    f"Ray could not place {n} engine cores of {self.bundle} with strategy "
                    f"{config.ray_placement_strategy} within {config.distributed_timeout_s:.0f} s "
                    f"(cluster resources: {ray.cluster_resources()})")

    def client(self, core_config: EngineConfig, index: int, sink) -> "RayEngineCoreProc":
        return RayEngineCoreProc(core_config, index, sink, cores=self)

    def start_actor(self, core_config: EngineConfig, index: int):
        """Start core ``index``'s actor and connect to it: (connection, process handle, node id, node ip)."""
        from multiprocessing.connection import Client

        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        if self.bundle is not None:
            cls = ray.remote(num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0))(EngineCoreActor)
            cls = cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=index))
        else:
            cls = ray.remote(num_cpus=0)(EngineCoreActor)
        authkey = os.urandom(32)
        actor = cls.remote(core_config, authkey)
        try:
            ip, port, pid, node_id = ray.get(actor.address.remote(), timeout=self.config.distributed_timeout_s)
            run_ref = actor.run.remote()
            deadline = time.monotonic() + self.config.distributed_timeout_s
            while True:  # the listener exists already: this waits only for run() to accept
                try:
                    conn = Client((ip, port), authkey=authkey)
                    break
                except ConnectionRefusedError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        except BaseException:
            try:
                ray.kill(actor)
            except Exception:
                pass
            raise
        return conn, _ActorProcess(ray, actor, run_ref, pid), node_id, ip

    def shutdown(self) -> None:
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
        if self._holds_ray:  # after the core actors (their clients shut them down first)
            self._holds_ray = False
            release_ray()


class RayEngineCoreProc(EngineCoreProc):
    """An EngineCoreProc whose core is a Ray actor, reached over a TCP connection."""

    def __init__(self, config: EngineConfig, index: int, sink, *, cores: RayEngineCores) -> None:
        self._cores = cores
        self.node_id: str | None = None
        self.node_ip: str | None = None  # where the core's own servers listen (the P/D TCP transport)
        super().__init__(config, index, sink)

    def _launch(self, config: EngineConfig):
        conn, proc, self.node_id, self.node_ip = self._cores.start_actor(config, self.index)
        return conn, proc

    @property
    def kv_transfer_address(self) -> str | None:
        """Its port at the node Ray placed it on (it binds every address of that node)."""
        bound = super().kv_transfer_address
        return None if bound is None else f"{self.node_ip}:{bound.rpartition(':')[2]}"

    def shutdown(self, timeout: float = 10.0) -> None:
        super().shutdown(timeout)
        self.proc.kill()  # the actor's process has exited by now; this releases Ray's record of it
