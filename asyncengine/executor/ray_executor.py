"""RayExecutor (``ray``): the tensor- and pipeline-parallel ranks as Ray actors, on any number of nodes.

The actors are placed by a placement group with one bundle per rank (strategy from
``EngineConfig.ray_placement_strategy``: ``PACK`` by default, ``STRICT_SPREAD`` for one rank per
node); each holds one :class:`~asyncengine.worker.worker.Worker`, and the ranks form a
torch.distributed group (gloo on CPU, NCCL on CUDA) at rank 0's node address. The step protocol is
the ``mp`` executor's: the same msgspec bytes to every rank, rank 0's bytes back. A failed or lost
actor fails every pending step with EngineDeadError.

Ray is optional (``pip install 'asyncengine[ray]'``). The engine connects to the cluster the
process is already connected to, else to ``$RAY_ADDRESS``, else starts a local one, which it stops
at shutdown (``acquire_ray``/``release_ray``). Every node
needs this package and the model at the same path. See docs/distributed.md.
"""
from __future__ import annotations

import logging
import os
import pickle
import threading
from concurrent.futures import Future

from asyncengine.config import EngineConfig
from asyncengine.contracts.sched_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.errors import ConfigError, EngineDeadError
from asyncengine.executor import messages as M
from asyncengine.executor.abstract import Executor

log = logging.getLogger(__name__)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("distributed_executor_backend='ray' needs Ray, which is not installed: "
                          "pip install 'asyncengine[ray]'") from None
    return ray


# The Ray connection this package opened (and, without RAY_ADDRESS, the local cluster ray.init
# started), shared by the engines of this process that use it: the last one to shut down closes it,
# so an embedded engine leaves no Ray process behind. A connection the app opened is the app's.
_ray_lock = threading.Lock()
_ray_owned = False
_ray_users = 0


def acquire_ray():
    """Ray, connected (to the cluster the process is connected to, else ``$RAY_ADDRESS``, else a new
    local one); returns (ray, whether this package holds the connection: then call release_ray)."""
    global _ray_owned, _ray_users
    ray = _import_ray()
    with _ray_lock:
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
            _ray_owned = True
        if not _ray_owned:
            return ray, False
        _ray_users += 1
        return ray, True


def release_ray() -> None:
    """One user of the connection this package opened is done; the last one shuts it down."""
    global _ray_owned, _ray_users
    with _ray_lock:
        _ray_users -= 1
        if _ray_users > 0 or not _ray_owned:
            return
        _ray_owned = False
        import ray

        try:
            ray.shutdown()
        except Exception:  # already gone
            log.warning("ray.shutdown() failed", exc_info=True)


class RayWorkerWrapper:
    """The actor body: a Worker plus what the driver needs to wire the ranks together."""

    def __init__(self, config, rank: int, world_size: int, eos_token_ids, hf_config) -> None:
        self.args = (config, rank, world_size, eos_token_ids, hf_config)
        self.worker = None

    def node_address(self) -> tuple[str, int, str]:
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ip, port, ray.get_runtime_context().get_node_id()

    def setup(self, init_method: str) -> int:
        from asyncengine.worker.worker import Worker  # lazy: the worker (torch, the models) loads in the process that runs it

        config, rank, world_size, eos, hf_config = self.args
        self.worker = Worker(config, rank=rank, world_size=world_size, distributed_init_method=init_method,
                             eos_token_ids=eos, hf_config=hf_config)
        self.worker.init_device()
        self.worker.load_model()
        return os.getpid()

    def execute(self, data: bytes) -> bytes | None:
        msg = M.decode_request(data)
        out = self.worker.execute_model(msg.scheduler_output)
        return None if out is None else M.encode(M.StepResult(output=out))

    def rpc(self, data: bytes) -> bytes:
        return pickle.dumps(M.run_rpc(self.worker, M.decode_request(data)))

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, model_info, loaded=None) -> None:
        super().__init__(config, model_info, loaded)
        ray, self._holds_ray = acquire_ray()
        self.ray = ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_pg = remove_placement_group
        n = self.world_size = config.world_size
        self.output_rank = n - config.tensor_parallel_size  # tensor rank 0 of the last stage
        cuda = config.torch_device.type == "cuda"
        bundle = {"CPU": 1, "GPU": 1} if cuda else {"CPU": 1}
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy=config.ray_placement_strategy)
        self._dead: EngineDeadError | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        try:
            ready, _ = ray.wait([self.pg.ready()], timeout=config.distributed_timeout_s)
            if not ready:
                raise EngineDeadError(
                    f"Ray could not place {n} bundles of {bundle} with strategy {config.ray_placement_strategy} "
                    f"within {config.distributed_timeout_s:.0f} s (cluster resources: {ray.cluster_resources()})")
            actor_cls = ray.remote(num_cpus=1, num_gpus=1 if cuda else 0)(RayWorkerWrapper)
            self.actors = [
                actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=r)).remote(
                    config, r, n, self.eos_token_ids, self.hf_config_dict)
                for r in range(n)]
            ip, port, _ = ray.get(self.actors[0].node_address.remote())
            init_method = f"tcp://{ip}:{port}"
            self.pids = ray.get([a.setup.remote(init_method) for a in self.actors])
            self.node_ids = ray.get([a.node_id.remote() for a in self.actors])
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ failure

    def _die(self, why: str) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = EngineDeadError(why)
            pending = list(self._pending)
            self._pending.clear()
        log.error("ray executor: %s", why)
        for f in pending:
            if not f.done():
                f.set_exception(EngineDeadError(why))
        # the others may be stuck in a collective: end them, from a thread of our own (this may
        # run in a callback on Ray's own io thread, where calling back into Ray deadlocks)
        threading.Thread(target=self._kill_actors, daemon=True, name="asyncengine-ray-kill").start()

    def _kill_actors(self) -> None:
        for a in getattr(self, "actors", []):
            try:
                self.ray.kill(a)
            except Exception:
                pass

    # ------------------------------------------------------------------ the Executor interface

    def execute_model(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        out: Future = Future()
        if self._dead is not None or self._closing:
            out.set_exception(EngineDeadError(str(self._dead or "the executor was shut down")))
            return out
        data = M.encode(M.ExecuteModel(scheduler_output))
        refs = [a.execute.remote(data) for a in self.actors]
        with self._lock:
            self._pending.add(out)

        def rank_done(rank: int, f: Future) -> None:
            try:
                result = f.result()
            except BaseException as e:
                self._die(f"worker rank {rank} failed: {type(e).__name__}: {e}")
                return
            if rank == self.output_rank:
                with self._lock:
                    self._pending.discard(out)
                if not out.done():
                    out.set_result(M.decode_reply(result).output)
        for r, ref in enumerate(refs):
            ref.future().add_done_callback(lambda f, r=r: rank_done(r, f))
        return out

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None, non_block=False):
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        data = M.encode(M.make_rpc(method, tuple(args), kwargs))
        refs = [a.rpc.remote(data) for a in self.actors]
        out: Future = Future()

        def gather() -> None:
            try:
                out.set_result([pickle.loads(b) for b in self.ray.get(refs, timeout=timeout)])
            except BaseException as e:
                out.set_exception(e)
        if non_block:
            threading.Thread(target=gather, daemon=True).start()
            return out
        gather()
        return out.result()

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if self._closing:
            raise EngineDeadError("the executor was shut down")
        try:
            self.ray.get([a.node_id.remote() for a in self.actors], timeout=self.config.distributed_timeout_s)
        except Exception as e:
            self._die(f"a worker actor is gone: {type(e).__name__}: {e}")
            raise EngineDeadError(str(self._dead)) from None

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._kill_actors()
        try:
            self._remove_pg(self.pg)
        except Exception:
            pass
        if self._holds_ray:
            self._holds_ray = False
            release_ray()
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        for f in pending:
            if not f.done():
                f.set_exception(EngineDeadError("the executor was shut down"))
