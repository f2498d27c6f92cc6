"""The P/D connector's worker side: write a prompt's blocks to its transfer file after the forward
(prefill core), or copy a claimed file's blocks in before it and delete the file (decode core)."""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from asyncengine.kv_connector.base import WorkerConnector
from asyncengine.contracts.connector_messages import KVConnectorMetadata, KVConnectorOutput
from asyncengine.kv_connector.offload.host_pool import HostPool
from asyncengine.kv_connector.pd import transfer_file as tf

log = logging.getLogger(__name__)
SWEEP_EVERY_S = 1.0


class PDWorker(WorkerConnector):
    def __init__(self, pool: HostPool, transport, directory: str, fingerprint: bytes, lease_s: float,
                 sweeps: bool) -> None:
        # the prefill cores sweep the directory (about once a second, after a step): unclaimed shm
        # transfers, and files claimed by decode cores that died
        self.sweeps = sweeps
        self.pool = pool  # one slot: used for its gather/scatter, not as a cache
        self.transport = transport  # kv_connector/pd/transport.py: where exports go
        self.dir = directory
        self.fingerprint = fingerprint
        self.lease_s = lease_s
        self._last_sweep = 0.0
        self.counters: dict[str, int] = {}
        os.makedirs(directory, exist_ok=True)

    def serving_address(self) -> str | None:
        server = getattr(self.transport, "server", None)  # tcp: the prefill core's transfer server
        return server.address if server is not None else None

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def before_forward(self, meta: KVConnectorMetadata | None) -> None:
        if meta is None or not meta.import_kv:
            return
        t0 = time.perf_counter()
        nbytes = self.pool.block_nbytes
        row_shape = self.pool.slots.shape[1:]
        for job in meta.import_kv:
            n = len(job.block_ids)
            buf = torch.empty((n, *row_shape), dtype=self.pool.slots.dtype)
            view = buf.view(torch.uint8).reshape(-1).numpy()
            # the file is claimed by this core: if it is not whole, something outside broke the
            # protocol, and computing on missing KV would be wrong output, so fail loudly
            with open(job.path, "rb") as f:
                f.seek(tf.HEADER_SIZE + job.first * nbytes)
                got = f.readinto(memoryview(view))
            if got != n * nbytes:
                raise RuntimeError(f"kv transfer file {job.path} ended early ({got} of {n * nbytes} bytes)")
            self.pool.scatter(job.block_ids, buf)
            os.unlink(job.path)
            self._count("transfer_read_bytes", n * nbytes)
        self._count("transfer_read_us", int((time.perf_counter() - t0) * 1e6))

    def after_forward(self, meta: KVConnectorMetadata | None) -> None:
        if self.sweeps and time.monotonic() - self._last_sweep >= SWEEP_EVERY_S:
            self._last_sweep = time.monotonic()
            swept = tf.sweep(self.dir, self.lease_s)
            if swept:
                self._count("transfer_swept_files", swept)
        if meta is None or not meta.export:
            return
        t0 = time.perf_counter()
        for job in meta.export:
            rows = self.pool.blocks_bytes(job.block_ids)
            header = tf.Header(self.fingerprint, job.prompt_digest, job.num_tokens, len(job.block_ids),
                               self.pool.block_nbytes)
            try:
                self.transport.put(job.key, header, np.ascontiguousarray(rows.numpy()))
                self._count("transfer_written_bytes", rows.numel())
            except OSError as e:  # shared memory full: the decode core computes the prompt itself
                log.warning("kv transfer: writing the transfer of %r failed (%s)", job.key, e)
                self._count("transfer_write_errors")
        self._count("transfer_write_us", int((time.perf_counter() - t0) * 1e6))

    def take_output(self) -> KVConnectorOutput | None:
        if not self.counters:
            return None
        out = KVConnectorOutput(counters=self.counters)
        self.counters = {}
        return out

    def close(self) -> None:
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()
