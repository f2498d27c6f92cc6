"""The P/D connector's scheduler sides.

Prefill core (:class:`PrefillExporter`): in the step that computes the end of a request's prompt,
ask the worker to hand the prompt's blocks to the transport (kv_connector/pd/transport.py: a transfer
file, or the prefill core's TCP server) right after the forward. The request then finishes as usual
(the front end asks a prefill core for one token) and its blocks are freed at once: the copy is the
transfer, so no block is held for a decode core that may never come (the transfer's own lease is
the sweep's).

Decode core (:class:`DecodeImporter`): when a request is looked at, its transfer (whole, same
fingerprint, same prompt; over TCP: pulled from the address in the request's ``kv_transfer_params``)
is claimed as a local file and its tokens up to the prompt's last count as external:
they are copied in before this step's forward and only the last prompt token is computed, as with a
prefix-cache hit. No file (the prefill core failed, the transfer was swept, the request came
straight here): the decode core computes the prompt itself, counted as a miss. Over TCP the claim
is a pull across the network: it runs on a thread while the request waits (an asynchronous load,
core/kv_transfer_state.py), so the running requests' steps never wait for another request's bytes.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

from asyncengine.kv_connector.base import SchedulerConnector
from asyncengine.contracts.connector_messages import ExportJob, ImportJob, KVConnectorMetadata
from asyncengine.kv_connector.pd import transfer_file as tf
from asyncengine.kv_connector.pd.tcp_server import BadTransfer

if TYPE_CHECKING:
    from asyncengine.core.kv_cache_manager import KVCacheManager
    from asyncengine.core.request import Request

log = logging.getLogger(__name__)

PULL_THREADS = 4  # pulls in flight at once per decode core
PULL_POLL_S = 0.005  # an idle step waits this long for a pull to end


def _digest(req: "Request") -> bytes:
    return tf.prompt_digest(req.prompt_token_ids, req.block_extra(0, req.num_prompt_tokens))


def transfer_key(req: "Request") -> str | None:
    """The id a transfer file is named by: the user's request id (sample 0 of an ``n > 1`` request
    imports it; the other samples share sample 0's blocks through the prefix cache)."""
    if req.parent_id is None:
        return req.request_id
    from asyncengine.core.request import child_request_id  # lazy: only for n > 1 samples

    return req.parent_id if req.request_id == child_request_id(req.parent_id, 0) else None


class PrefillExporter(SchedulerConnector):
    def __init__(self, kv: "KVCacheManager") -> None:
        self.kv = kv
        self.counters = {"kv_transfer_exported_requests": 0, "kv_transfer_exported_tokens": 0}

    def get_num_new_matched_tokens(self, req, num_computed):
        return 0, False

    def update_state_after_alloc(self, req, blocks, num_computed, num_external):
        pass

    def build_meta(self, scheduled: dict[str, int], requests: dict) -> KVConnectorMetadata | None:
        jobs = []
        bs = self.kv.block_size
        for rid, n in scheduled.items():
            req = requests[rid]
            end, p = req.num_computed_tokens, req.num_prompt_tokens
            key = transfer_key(req)
            if key is None or not end - n < p <= end:
                continue
            jobs.append(ExportJob(key=key, block_ids=self.kv.block_ids(rid)[:-(-p // bs)],
                                  num_tokens=p, prompt_digest=_digest(req)))
            self.counters["kv_transfer_exported_requests"] += 1
            self.counters["kv_transfer_exported_tokens"] += p
        return KVConnectorMetadata(export=jobs) if jobs else None

    def update_connector_output(self, out):
        for k, v in out.counters.items():
            self.counters["kv_" + k] = self.counters.get("kv_" + k, 0) + v
        return [], []

    def request_finished(self, req):
        return None

    def stats(self) -> dict:
        return dict(self.counters)


class DecodeImporter(SchedulerConnector):
    def __init__(self, kv: "KVCacheManager", transport, fingerprint: bytes, block_nbytes: int) -> None:
        self.kv = kv
        self.transport = transport  # kv_connector/pd/transport.py
        self.fingerprint = fingerprint
        self.block_nbytes = block_nbytes
        self._claims: dict[str, tuple[str, int]] = {}  # request id -> (claimed file, tokens in it)
        self._imports: list[ImportJob] = []
        self.counters = {"kv_transfer_imported_requests": 0, "kv_transfer_imported_tokens": 0,
                         "kv_transfer_misses": 0, "kv_transfer_rejected_files": 0}
        # over the network a claim is a pull (milliseconds to seconds): it runs on a thread while
        # the request waits (asynchronous load) and the running requests keep stepping
        self._pull_slots = threading.BoundedSemaphore(PULL_THREADS) if transport.claims_over_network else None
        self._pulls: dict[str, Future] = {}  # request id -> its pull in flight
        self._pulled: set[str] = set()  # pulled (found or not): not pulled again (a preemption, say)
        self._orphans: set[str] = set()  # left while their pull was in flight: drop what it brings

    def _fetch(self, req: "Request") -> tuple[tuple[str, int] | None, bool]:
        """Claim the request's transfer: ((local file, tokens in it) or None, whether one arrived
        and was refused). Touches nothing of the scheduler's: it may run on a pull thread."""
        refused = []

        def accept(h: tf.Header) -> bool:
            ok = (h.fingerprint == self.fingerprint and h.block_nbytes == self.block_nbytes
                  and h.num_tokens == req.num_prompt_tokens and h.digest == _digest(req))
            if not ok:
                refused.append(h)  # another model/layout, or not this prompt
            if h.fingerprint != self.fingerprint:
                log.warning("request %s: refused its KV transfer: the producer's KV layout differs from ours (model, "
                            "dtype, kv_cache_dtype, attention backend, block size or TP size); computing the "
                            "prompt here", req.request_id)
            return ok

        source = (req.kv_transfer_params or {}).get("source")
        try:
            got = self.transport.claim(transfer_key(req), source, accept)
        except BadTransfer as e:  # short or corrupt on the way: computed here instead, never loaded
            log.warning("%s: computing the prompt instead", e)
            return None, True
        return (None if got is None else (got[0], got[1].num_tokens)), bool(refused)

    def _start_pull(self, req: "Request") -> Future:
        """``_fetch(req)`` on a daemon thread of its own, at most PULL_THREADS at once (daemon: a
        peer that stalls mid-transfer never holds the process's exit, as a pool's threads would)."""
        fut: Future = Future()

        def run() -> None:
            with self._pull_slots:
                try:
                    fut.set_result(self._fetch(req))
                except BaseException as e:
                    fut.set_exception(e)

        threading.Thread(target=run, daemon=True, name="asyncengine-kv-pull").start()
        return fut

    def _settle(self, rid: str, fetched: tuple[tuple[str, int] | None, bool]) -> tuple[str, int] | None:
        claim, refused = fetched
        if refused:
            self.counters["kv_transfer_rejected_files"] += 1
        if claim is not None:
            self._claims[rid] = claim
        return claim

    def get_num_new_matched_tokens(self, req, num_computed):
        if req.sampling_params.needs_every_prompt_row:
            return 0, False
        rid = req.request_id
        claim = self._claims.get(rid)
        if claim is None and rid not in self._pulled and transfer_key(req) is not None:
            if self._pull_slots is None:
                claim = self._settle(rid, self._fetch(req))
            elif (req.kv_transfer_params or {}).get("source") is not None:  # (none: nothing to pull)
                if rid not in self._pulls:
                    self._pulls[rid] = self._start_pull(req)
                return 0, True  # looked at again once update_connector_output reports the pull ended
        if claim is None:
            return 0, False
        return max(0, min(claim[1], req.num_tokens - 1) - num_computed), False

    def update_state_after_alloc(self, req, blocks, num_computed, num_external):
        if not num_external:
            if req.request_id not in self._claims and req.num_preemptions == 0 and transfer_key(req) is not None:
                self.counters["kv_transfer_misses"] += 1
            self._drop(req.request_id)  # a prefix hit covered it all, or nothing to import
            return
        path, _ = self._claims.pop(req.request_id)
        bs = self.kv.block_size
        first, last = num_computed // bs, -(-(num_computed + num_external) // bs)
        self._imports.append(ImportJob(path=path, first=first, block_ids=[b.block_id for b in blocks[first:last]]))
        self.counters["kv_transfer_imported_requests"] += 1
        self.counters["kv_transfer_imported_tokens"] += num_external

    def build_meta(self, scheduled, requests):
        poll = bool(self._pulls) and not scheduled
        if poll:  # nothing to compute but pulls: wait for one here rather than spin on empty steps
            wait(list(self._pulls.values()), timeout=PULL_POLL_S, return_when=FIRST_COMPLETED)
        if not self._imports and not poll:
            return None
        meta = KVConnectorMetadata(import_kv=self._imports, poll=poll)
        self._imports = []
        return meta

    def update_connector_output(self, out):
        for k, v in out.counters.items():
            self.counters["kv_" + k] = self.counters.get("kv_" + k, 0) + v
        loaded = []
        for rid in [rid for rid, f in self._pulls.items() if f.done()]:
            fut = self._pulls.pop(rid)
            try:
                fetched = fut.result()
            except Exception:  # a pull that broke (not a refusal): the prompt is computed here
                log.exception("kv transfer: pulling %s failed; computing the prompt instead", rid)
                fetched = None, False
            if rid in self._orphans:
                self._orphans.discard(rid)
                if fetched[0] is not None:
                    _unlink(fetched[0][0])
                continue
            self._settle(rid, fetched)
            self._pulled.add(rid)
            loaded.append(rid)
        return loaded, []

    def request_finished(self, req):
        rid = req.request_id
        self._pulled.discard(rid)
        if rid in self._pulls:
            self._orphans.add(rid)
        self._drop(rid)
        return None

    def has_pending_transfers(self) -> bool:
        return bool(self._pulls)

    def _drop(self, rid: str) -> None:
        claim = self._claims.pop(rid, None)
        if claim is not None:
            _unlink(claim[0])

    def stats(self) -> dict:
        return {**self.counters, "kv_transfer_claimed_files": len(self._claims), "kv_transfer_pulls": len(self._pulls)}


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
