"""Several KV connectors on one core (vLLM's ``MultiConnector``): a decode core that imports P/D
transfers and keeps a host/disk tier of its prefix cache.

Scheduler side: a waiting request asks each connector in order for external tokens and takes the
first that has some (or loads asynchronously); that one is told the external tokens after the
allocation, the others are told none (so they count a miss and drop what they pinned). Every
connector builds its part of the step's metadata (one struct: each fills its own lists), hears of
every finished request and expired lease, and gets the worker's report with its own counters.

Worker side: every connector sees every step (each reads only its own lists); their reports are
merged, counters keyed by the connector's index so that each scheduler side folds in its own.
Before the forward the connectors run in reverse order: the one asked first (P/D) only loads, the
one after it (offload) saves blocks being evicted, and a block evicted this step may be the target
of this step's import, so its old contents must reach the host tier before the import overwrites
them (messages.py: saves first).
"""
from __future__ import annotations

import msgspec

from asyncengine.kv_connector.base import SchedulerConnector, WorkerConnector
from asyncengine.contracts.connector_messages import KVConnectorMetadata, KVConnectorOutput

_FIELDS = [f.name for f in msgspec.structs.fields(KVConnectorMetadata)]


def merge_meta(metas: list[KVConnectorMetadata | None]) -> KVConnectorMetadata | None:
    metas = [m for m in metas if m is not None]
    if len(metas) <= 1:
        return metas[0] if metas else None
    merged = {}
    for name in _FIELDS:
        values = [getattr(m, name) for m in metas]
        merged[name] = any(values) if isinstance(values[0], bool) else [x for v in values for x in v]
    return KVConnectorMetadata(**merged)


class MultiSchedulerConnector(SchedulerConnector):
    def __init__(self, connectors: list[SchedulerConnector]) -> None:
        self.connectors = connectors
        self._matched: dict[str, int] = {}  # request id -> the connector its external tokens come from

    def get_num_new_matched_tokens(self, req, num_computed):
        for i, c in enumerate(self.connectors):
            n, load_async = c.get_num_new_matched_tokens(req, num_computed)
            if n or load_async:
                self._matched[req.request_id] = i
                return n, load_async
        self._matched.pop(req.request_id, None)
        return 0, False

    def update_state_after_alloc(self, req, blocks, num_computed, num_external):
        matched = self._matched.pop(req.request_id, None)
        for i, c in enumerate(self.connectors):
            c.update_state_after_alloc(req, blocks, num_computed, num_external if i == matched else 0)

    def build_meta(self, scheduled, requests):
        return merge_meta([c.build_meta(scheduled, requests) for c in self.connectors])

    def update_connector_output(self, out):
        loaded: list[str] = []
        sent: list[str] = []
        for i, c in enumerate(self.connectors):
            prefix = f"{i}:"
            own = {k[len(prefix):]: v for k, v in out.counters.items() if k.startswith(prefix)}
            ld, st = c.update_connector_output(KVConnectorOutput(
                finished_stages=out.finished_stages, finished_sending=out.finished_sending, counters=own))
            loaded += [r for r in ld if r not in loaded]
            sent += [r for r in st if r not in sent]
        return loaded, sent

    def request_finished(self, req):
        self._matched.pop(req.request_id, None)
        leases = [s for s in (c.request_finished(req) for c in self.connectors) if s is not None]
        return max(leases) if leases else None

    def lease_expired(self, request_id):
        for c in self.connectors:
            c.lease_expired(request_id)

    def has_pending_transfers(self):
        return any(c.has_pending_transfers() for c in self.connectors)

    def stats(self):
        out: dict = {}
        for c in self.connectors:
            out.update(c.stats())
        return out


class MultiWorkerConnector(WorkerConnector):
    def __init__(self, connectors: list[WorkerConnector]) -> None:
        self.connectors = connectors

    def before_forward(self, meta):
        for c in reversed(self.connectors):  # saves (offload) before loads (P/D): see above
            c.before_forward(meta)

    def after_forward(self, meta):
        for c in self.connectors:
            c.after_forward(meta)

    def take_output(self):
        outs = [(i, c.take_output()) for i, c in enumerate(self.connectors)]
        outs = [(i, o) for i, o in outs if o is not None]
        if not outs:
            return None
        return KVConnectorOutput(finished_stages=[s for _, o in outs for s in o.finished_stages],
                                 finished_sending=[r for _, o in outs for r in o.finished_sending],
                                 counters={f"{i}:{k}": v for i, o in outs for k, v in o.counters.items()})

    def serving_address(self):
        return next((a for a in (c.serving_address() for c in self.connectors) if a is not None), None)

    def close(self):
        for c in self.connectors:
            c.close()
