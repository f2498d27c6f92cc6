"""The offload connector's scheduler side: the host pool's index, the disk tier's index, and the
decisions.

* A cached device block that allocation evicts is saved to a host slot (``on_block_evicted``; the
  copy is planned in ``build_meta``, after this step's loads have pinned their slots).
* A waiting request's prompt blocks past its device hit that sit in the host pool are loaded
  synchronously: they count as computed and the worker copies them in before the forward.
* Blocks past those that sit on disk are first *staged*: read into host slots by the worker's
  reader thread while the request waits outside the queue (no sequence slot, no device blocks);
  when the read ends the request queues again at the front and loads them from the host. A block
  that failed to read (gone, foreign, corrupt) is forgotten and computed instead. A request stages
  at most once.
* Full prompt blocks are written to disk after the step that computes them (``persist``), unless
  the disk tier has them already.
"""
from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING

from asyncengine.kv_connector.base import SchedulerConnector
from asyncengine.contracts.connector_messages import KVConnectorMetadata, KVConnectorOutput, StageJob
from asyncengine.kv_connector.offload.disk_store import DiskStore
from asyncengine.kv_connector.offload.host_index import HostIndex

if TYPE_CHECKING:
    from asyncengine.core.block_pool import KVBlock
    from asyncengine.core.kv_cache_manager import KVCacheManager
    from asyncengine.core.request import Request


class DiskIndex:
    """Which block hashes the disk tier has: the folder's listing at start, our own writes, and a
    stat for a hash not seen yet (another process may have written it since)."""

    def __init__(self, store: DiskStore) -> None:
        self.store = store
        self.known = store.list_hashes()
        self.writable = store.probe_writable() is None  # the worker warns; here: plan no writes

    def __contains__(self, h: bytes) -> bool:
        if h in self.known:
            return True
        if os.path.exists(self.store.path(h)):
            self.known.add(h)
            return True
        return False

    def forget(self, h: bytes) -> None:
        self.known.discard(h)


class OffloadScheduler(SchedulerConnector):
    def __init__(self, kv: "KVCacheManager", num_host_slots: int, disk: DiskStore | None) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.host = HostIndex(num_host_slots)
        self.disk = DiskIndex(disk) if disk is not None else None
        self._evicted: list[tuple[int, bytes]] = []  # device blocks evicted while building this step
        self._cached: list[tuple["KVBlock", bytes]] = []  # prompt blocks registered this step
        self._loads: list[tuple[int, int]] = []
        self._step_pins: list[int] = []
        self._jobs: dict[int, tuple[str, list[tuple[bytes, int]]]] = {}  # job id -> (request id, blocks)
        self._new_jobs: list[StageJob] = []
        self._job_ids = itertools.count()
        self._req_pins: dict[str, list[int]] = {}  # request id -> host slots kept for its admission
        self._staged_once: set[str] = set()
        self.counters = {"kv_offload_host_hit_tokens": 0, "kv_offload_disk_hit_tokens": 0,
                         "kv_offload_miss_tokens": 0, "kv_offload_disk_bad_blocks": 0}
        self.worker_counters: dict[str, int] = {}
        kv.pool.on_evict = self.on_block_evicted
        kv.on_blocks_cached = self.on_blocks_cached

    # ------------------------------------------------------------------ hooks from the KV manager

    def on_block_evicted(self, block: "KVBlock", block_hash: bytes) -> None:
        self._evicted.append((block.block_id, block_hash))

    def on_blocks_cached(self, req: "Request", blocks: list["KVBlock"], start: int, end: int) -> None:
        if self.disk is None:
            return
        last = min(end, req.num_prompt_tokens // self.block_size)
        for i in range(start, last):
            self._cached.append((blocks[i], req.block_hashes[i]))

    # ------------------------------------------------------------------ the seam

    def _host_run(self, hashes: list[bytes], i: int, end: int) -> int:
        j = i
        while j < end and self.host.lookup(hashes[j]) is not None:
            j += 1
        return j

    def get_num_new_matched_tokens(self, req: "Request", num_computed: int) -> tuple[int, bool]:
        if req.sampling_params.needs_every_prompt_row:
            return 0, False
        bs = self.block_size
        hashes = req.block_hashes
        end = min(len(hashes), (req.num_tokens - 1) // bs)  # the last token is always computed
        first = num_computed // bs
        j = self._host_run(hashes, first, end)
        if self.disk is None or j >= end or req.request_id in self._staged_once:
            return (j - first) * bs, False
        k = j
        # up to the next block the host already holds or is reading (the host evicts on its own,
        # so a prefix can have a gap there): those are found by the next look, not staged twice
        while (k < end and self.host.lookup(hashes[k]) is None and not self.host.is_pending(hashes[k])
               and hashes[k] in self.disk):
            k += 1
        if k == j:
            return (j - first) * bs, False
        # stage hashes[j:k] from disk, then look again; keep the host run before it for this request
        blocks = []
        for h in hashes[j:k]:
            slot = self.host.allocate(h, pending=True)
            if slot is None:
                break
            self.host.pin(slot)
            blocks.append((h, slot))
        if not blocks:
            return (j - first) * bs, False
        job_id = next(self._job_ids)
        self._jobs[job_id] = (req.request_id, blocks)
        self._new_jobs.append(StageJob(job_id=job_id, blocks=blocks))
        self._staged_once.add(req.request_id)
        pins = [self.host.lookup(h) for h in hashes[first:j]] + [s for _, s in blocks]
        for s in pins:
            self.host.pin(s)
        self._req_pins[req.request_id] = pins
        return 0, True

    def update_state_after_alloc(self, req: "Request", blocks: list["KVBlock"], num_computed: int,
                                 num_external: int) -> None:
        bs = self.block_size
        first = num_computed // bs
        for i in range(first, first + num_external // bs):
            h = req.block_hashes[i]
            slot = self.host.lookup(h)
            self.host.touch(h)
            self.host.pin(slot)
            self._step_pins.append(slot)
            self._loads.append((slot, blocks[i].block_id))
        self.counters["kv_offload_host_hit_tokens"] += num_external
        self.counters["kv_offload_miss_tokens"] += req.num_tokens - num_computed - num_external
        self._release_request(req.request_id)

    def build_meta(self, scheduled: dict[str, int], requests: dict) -> KVConnectorMetadata | None:
        idle = not scheduled
        saves = []
        for block_id, h in self._evicted:
            if self.host.lookup(h) is not None:
                self.host.touch(h)
                continue
            if self.host.is_pending(h):
                continue
            slot = self.host.allocate(h)
            if slot is not None:
                saves.append((block_id, slot))
        persist = []
        if self._cached and self.disk.writable:
            cached = self.kv.pool.cached
            for b, h in self._cached:
                # still registered (a preempted chunk un-registers what it would have written)
                if cached.get(h) is b and h not in self.disk.known:
                    persist.append((b.block_id, h))
                    self.disk.known.add(h)
        meta = KVConnectorMetadata(save_to_host=saves, load_from_host=self._loads, stage_from_disk=self._new_jobs,
                                   persist=persist, poll=idle and bool(self._jobs))
        for s in self._step_pins:
            self.host.unpin(s)
        self._evicted, self._cached, self._loads, self._new_jobs, self._step_pins = [], [], [], [], []
        return None if meta.is_empty else meta

    def update_connector_output(self, out: KVConnectorOutput) -> tuple[list[str], list[str]]:
        for k, v in out.counters.items():
            self.worker_counters[k] = self.worker_counters.get(k, 0) + v
        ready = []
        for res in out.finished_stages:
            rid, blocks = self._jobs.pop(res.job_id)
            failed = set(res.failed)
            for h, slot in blocks:
                self.host.unpin(slot)
                if h in failed:
                    self.host.discard(h)
                    self.disk.forget(h)
                    self.counters["kv_offload_disk_bad_blocks"] += 1
                else:
                    self.host.commit(h)
                    self.counters["kv_offload_disk_hit_tokens"] += self.block_size
            ready.append(rid)
        return ready, []

    def request_finished(self, req: "Request") -> float | None:
        self._release_request(req.request_id)
        self._staged_once.discard(req.request_id)
        return None  # nothing reads a finished request's blocks: free them now

    def _release_request(self, rid: str) -> None:
        for s in self._req_pins.pop(rid, ()):
            self.host.unpin(s)

    # ------------------------------------------------------------------ introspection

    def has_pending_transfers(self) -> bool:
        return bool(self._jobs)

    def stats(self) -> dict:
        out = dict(self.counters)
        out["kv_offload_host_blocks"] = len(self.host)
        out["kv_offload_host_slots"] = self.host.num_slots
        out["kv_offload_pinned_slots"] = self.host.num_pinned
        out["kv_offload_pending_stages"] = len(self._jobs)
        for k, v in self.worker_counters.items():
            out["kv_offload_" + k] = v
        return out
