"""The offload connector's worker side: applies each step's transfers and runs the two background
threads that keep disk I/O off the step's critical path.

* The **reader** executes stage jobs (disk -> host slots). Results are reported in the next steps'
  outputs; the scheduler keeps the request waiting meanwhile, without a sequence slot or blocks.
* The **writer** writes persisted blocks (copied out of the cache right after the forward that
  computed them) to the disk tier. Its queue is bounded (64 MiB of copies): when the disk cannot
  keep up, blocks are dropped and counted, the step never waits. ``close()`` drains it (a clean shutdown keeps every
  block computed); an ``atexit`` hook does the same for an engine nobody shut down.

A read-only directory disables writes with one warning; a full disk disables them at the first
ENOSPC with one warning. Reads go on either way.
"""
from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections import Counter

from asyncengine.kv_connector.base import WorkerConnector
from asyncengine.contracts.connector_messages import KVConnectorMetadata, KVConnectorOutput, StageJob, StageResult
from asyncengine.kv_connector.offload.disk_store import BadBlockFile, DiskStore, is_out_of_space
from asyncengine.kv_connector.offload.host_pool import HostPool

log = logging.getLogger(__name__)

MAX_PENDING_WRITE_BYTES = 64 << 20  # copies queued for the writer (beyond: dropped, counted)
POLL_WAIT_S = 0.005  # an idle step waits this long for a disk read to finish


class OffloadWorker(WorkerConnector):
    def __init__(self, pool: HostPool, disk: DiskStore | None) -> None:
        self.pool = pool
        self.disk = disk
        self.counters: Counter = Counter()
        self._lock = threading.Lock()  # counters and finished stages, shared with the threads
        self._finished: list[StageResult] = []
        self._stage_done = threading.Event()
        self._reads: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue(maxsize=max(16, MAX_PENDING_WRITE_BYTES // pool.block_nbytes))
        self.writable = False
        self._threads: list[threading.Thread] = []
        self._closed = False
        if disk is not None:
            err = disk.probe_writable()
            if err is None:
                self.writable = True
            else:
                log.warning("kv offload: %s is not writable (%s): the disk tier only serves blocks already "
                            "there", disk.root, err)
            self._start("asyncengine-kv-read", self._read_loop)
            if self.writable:
                self._start("asyncengine-kv-write", self._write_loop)
            ref = weakref.ref(self)
            atexit.register(lambda: (w := ref()) is not None and w.close())

    def _start(self, name: str, fn) -> None:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _count(self, **kw) -> None:
        with self._lock:
            self.counters.update(kw)

    # ------------------------------------------------------------------ the step

    def before_forward(self, meta: KVConnectorMetadata | None) -> None:
        if meta is None:
            return
        if meta.save_to_host:
            self.pool.save(meta.save_to_host)
            self._count(host_saved_bytes=len(meta.save_to_host) * self.pool.block_nbytes)
        if meta.load_from_host:
            self.pool.load(meta.load_from_host)
            self._count(host_loaded_bytes=len(meta.load_from_host) * self.pool.block_nbytes)
        for job in meta.stage_from_disk:
            self._reads.put(job)
        if meta.poll:
            with self._lock:
                done = bool(self._finished)
            if not done:
                self._stage_done.wait(POLL_WAIT_S)
            self._stage_done.clear()

    def after_forward(self, meta: KVConnectorMetadata | None) -> None:
        if meta is None or not meta.persist:
            return
        if not self.writable:
            return
        payloads = self.pool.blocks_bytes([b for b, _ in meta.persist])
        for (_, h), payload in zip(meta.persist, payloads):
            try:
                self._writes.put_nowait((h, payload))
            except queue.Full:
                self._count(disk_writes_dropped=1)

    def take_output(self) -> KVConnectorOutput | None:
        with self._lock:
            if not self._finished and not self.counters:
                return None
            out = KVConnectorOutput(finished_stages=self._finished, counters=dict(self.counters))
            self._finished = []
            self.counters.clear()
        return out

    # ------------------------------------------------------------------ threads

    def _read_loop(self) -> None:
        while True:
            job: StageJob | None = self._reads.get()
            if job is None:
                return
            failed = []
            nread = 0
            for h, slot in job.blocks:
                try:
                    self.disk.read_into(h, self.pool.slot_buffer(slot))
                    nread += 1
                except BadBlockFile as e:
                    failed.append(h)
                    if not str(e).endswith(": gone"):
                        self._count(disk_bad_files=1)
            with self._lock:
                self._finished.append(StageResult(job_id=job.job_id, failed=failed))
                self.counters.update(disk_read_bytes=nread * self.pool.block_nbytes)
            self._stage_done.set()

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                if not self.writable:
                    continue
                h, payload = item
                try:
                    if self.disk.write(h, payload.numpy()):
                        self._count(disk_written_bytes=self.pool.block_nbytes)
                except OSError as e:
                    self.writable = False
                    self._count(disk_write_errors=1)
                    why = "the disk is full" if is_out_of_space(e) else str(e)
                    log.warning("kv offload: writing to %s failed (%s): the disk tier stops writing",
                                self.disk.root, why)
            finally:
                self._writes.task_done()

    def close(self) -> None:
        """Write what is queued, then stop the threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.disk is None:
            return
        self._reads.put(None)
        if self.writable:
            self._writes.put(None)
        for t in self._threads:
            t.join(timeout=60)
