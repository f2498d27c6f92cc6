"""The scheduler's side of KV transfers (kv_connector/base.py): requests waiting for their
prompt's KV to load from outside, and finished requests whose blocks are held for a transfer out.

Kept apart from the scheduler so that ``schedule()`` reads as batching; the scheduler owns one
(with no connector it holds nothing and makes none of the connector's calls).

A waiting request's prompt tokens past its prefix-cache hit may come from outside. Loaded
synchronously, they count as computed and only the rest is scheduled; loaded asynchronously, the
request waits in ``waiting_for_kv`` (no sequence slot, no blocks) until the connector reports the
load ended, then queues again at the front. When a request finishes, the connector may ask to hold
its blocks for a transfer (a prefill whose KV another core reads): they stay allocated under a
lease until the connector reports the transfer done or the lease runs out (then they are freed and
the connector told); an aborted request's blocks are the connector's to refuse to hold.
"""
from __future__ import annotations

import time

from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.request import Request
from asyncengine.contracts.connector_messages import KVConnectorOutput

_NO_REPORT = KVConnectorOutput()  # a step whose worker had nothing to say


class KVTransferState:
    def __init__(self, kv: KVCacheManager, connector, waiting) -> None:
        self.kv = kv
        self.connector = connector
        self.waiting = waiting  # the scheduler's queue: loaded requests go back to its front
        self.waiting_for_kv: dict[str, Request] = {}  # asynchronous loads in flight
        self.leases: dict[str, tuple[Request, float]] = {}  # finished, blocks held until (monotonic)
        self.num_leases_expired = 0

    def has_pending(self) -> bool:
        """Transfers still to hear back from (a read for a request aborted meanwhile still holds
        host slots until the worker reports it)."""
        return self.connector is not None and (bool(self.leases) or self.connector.has_pending_transfers())

    def request_finished(self, req: Request) -> None:
        """Free a finished request's blocks, or hold them under a lease if the connector asks to."""
        lease_s = self.connector.request_finished(req) if self.connector is not None else None
        if lease_s is None:
            self.kv.free(req)
        else:
            self.leases[req.request_id] = (req, time.monotonic() + lease_s)

    def expire_leases(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, (_, deadline) in self.leases.items() if deadline <= now]:
            self._release_lease(rid)
            self.num_leases_expired += 1
            self.connector.lease_expired(rid)

    def _release_lease(self, rid: str) -> None:
        lease = self.leases.pop(rid, None)
        if lease is not None:
            self.kv.free(lease[0])

    def step_done(self, kv_connector_output: KVConnectorOutput | None) -> None:
        """A step's transfer reports: loads that ended queue their requests again, at the front (they
        were first); blocks whose transfer out is done are freed. Called after every step (the
        worker may have said nothing while the scheduler side's own loads ended: P/D pulls)."""
        loaded, sent = self.connector.update_connector_output(kv_connector_output or _NO_REPORT)
        for rid in reversed(loaded):
            req = self.waiting_for_kv.pop(rid, None)
            if req is not None:
                self.waiting.push_front(req)
        for rid in sent:
            self._release_lease(rid)

    def stats(self) -> dict:
        """The connector's counters, and the blocks held for transfers (empty without a connector)."""
        if self.connector is None:
            return {}
        held = sum(len(self.kv.req_to_blocks.get(rid, ())) for rid in self.leases)
        return {**self.connector.stats(), "kv_leases_held": len(self.leases), "kv_blocks_held_for_transfer": held,
                "kv_leases_expired": self.num_leases_expired}
