"""Which connector a config asks for, on each side: the P/D connector for a core with a
``kv_role``, the offload connector whenever ``kv_offload_bytes`` or ``kv_offload_dir`` is set, both
(kv_connector/multi.py: P/D asked first) when both are, else none (None on both sides: not one
extra call per step).

Each takes the KV-transfer view of the config (config/sub_configs.py: KVTransferConfig) and
``fingerprint``, a callable that returns the cache layout's fingerprint
(kv_connector/offload/fingerprint.py: it reads the model, dtype, backend, block size and TP size,
so its caller, which holds the whole config, makes it); it is called only where a connector keeps
or loads blocks across engines."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from asyncengine.config.sub_configs import KVTransferConfig
    from asyncengine.core.kv_cache_manager import KVCacheManager
    from asyncengine.kv_connector.base import SchedulerConnector, WorkerConnector

log = logging.getLogger(__name__)


Fingerprint = Callable[[], bytes]


def _disk_store(config: "KVTransferConfig", fingerprint: Fingerprint, payload_bytes: int):
    if config.kv_offload_dir is None:
        return None
    from asyncengine.kv_connector.offload.disk_store import DiskStore  # lazy: only the configured connector's code loads

    return DiskStore(config.kv_offload_dir, fingerprint(), payload_bytes, config.kv_offload_dir_bytes)


def num_host_slots(config: "KVTransferConfig", bytes_per_block: int) -> int:
    return max(1, config.host_offload_bytes // bytes_per_block)


def transfer_dir(config: "KVTransferConfig") -> str:
    from asyncengine.kv_connector.pd.transfer_file import default_dir  # lazy: only the configured connector's code loads

    return config.kv_transfer_dir or default_dir()


def pd_transport(config: "KVTransferConfig", serve: bool = False):
    """The P/D transport of a core (kv_connector/pd/transport.py); ``serve``: a prefill core's
    worker, which serves its transfers (tcp) on ``kv_transfer_address``."""
    from asyncengine.kv_connector.pd.transport import make_transport  # lazy: only the configured connector's code loads

    serve_on = (config.kv_transfer_address or "127.0.0.1:0") if serve else None
    return make_transport(config.kv_transfer_transport, transfer_dir(config), serve_on, config.kv_transfer_lease_s)


def make_scheduler_connector(config: "KVTransferConfig", kv: "KVCacheManager", bytes_per_block: int,
                             fingerprint: Fingerprint) -> "SchedulerConnector | None":
    """``bytes_per_block``: one block of this rank's cache (what a host slot and a file hold)."""
    connectors = []
    if config.kv_role == "prefill":
        from asyncengine.kv_connector.pd.scheduler import PrefillExporter  # lazy: only the configured connector's code loads

        connectors.append(PrefillExporter(kv))
    elif config.kv_role == "decode":
        from asyncengine.kv_connector.pd.scheduler import DecodeImporter  # lazy: only the configured connector's code loads

        connectors.append(DecodeImporter(kv, pd_transport(config), fingerprint(), bytes_per_block))
    if config.offload_enabled:
        connectors.append(_offload_scheduler(config, kv, bytes_per_block, fingerprint))
    return _one(connectors, "MultiSchedulerConnector")


def _one(connectors: list, multi: str):
    if len(connectors) <= 1:
        return connectors[0] if connectors else None
    from asyncengine.kv_connector import multi as m  # lazy: only the configured connector's code loads

    return getattr(m, multi)(connectors)


def _offload_scheduler(config: "KVTransferConfig", kv: "KVCacheManager", bytes_per_block: int,
                       fingerprint: Fingerprint):
    from asyncengine.kv_connector.offload.scheduler import OffloadScheduler  # lazy: only the configured connector's code loads

    slots = num_host_slots(config, bytes_per_block)
    log.info("kv offload: host pool of %d blocks (%.0f MiB)%s", slots, slots * bytes_per_block / 2**20,
             f", disk tier {config.kv_offload_dir}" if config.kv_offload_dir else "")
    return OffloadScheduler(kv, slots, _disk_store(config, fingerprint, bytes_per_block))


def make_worker_connector(config: "KVTransferConfig", backend_name: str, kv_caches,
                          fingerprint: Fingerprint) -> "WorkerConnector | None":
    if not config.offload_enabled and config.kv_role is None:
        return None
    from asyncengine.kv_connector.offload.host_pool import HostPool, block_dim  # lazy: only the configured connector's code loads

    k0 = kv_caches[0][0]
    bytes_per_block = 2 * len(kv_caches) * k0.numel() // k0.shape[block_dim(backend_name)] * k0.element_size()
    connectors = []  # the scheduler side's order (multi.py: it runs their loads in reverse)
    if config.kv_role is not None:
        from asyncengine.kv_connector.pd.worker import PDWorker  # lazy: only the configured connector's code loads

        prefill = config.kv_role == "prefill"
        pool = HostPool(kv_caches, block_dim(backend_name), 1)
        connectors.append(PDWorker(pool, pd_transport(config, serve=prefill), transfer_dir(config),
                                   fingerprint(), config.kv_transfer_lease_s, sweeps=prefill))
    if config.offload_enabled:
        from asyncengine.kv_connector.offload.worker import OffloadWorker  # lazy: only the configured connector's code loads

        pool = HostPool(kv_caches, block_dim(backend_name), num_host_slots(config, bytes_per_block))
        assert pool.block_nbytes == bytes_per_block
        connectors.append(OffloadWorker(pool, _disk_store(config, fingerprint, bytes_per_block)))
    return _one(connectors, "MultiWorkerConnector")
