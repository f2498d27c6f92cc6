"""The request streams of one async engine and what reaches them: each finished batch's outputs
(detokenized by the output processor), an abort's last output, a request's own failure, and the
engine's death or move to another event loop. Runs on the engine's event loop only.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from asyncengine.contracts.sched_output import EngineCoreOutputs
from asyncengine.engine.admission import Admission
from asyncengine.engine.output_processor import OutputProcessor
from asyncengine.engine.request_stream import RequestSlot
from asyncengine.errors import EngineCoreDied, EngineDeadError, RequestFailedError
from asyncengine.outputs import CompletionOutput, RequestOutput

log = logging.getLogger("asyncengine.engine.async_engine")


class StreamRouter:
    def __init__(self, output_processor: OutputProcessor, admission: Admission, client) -> None:
        self.output_processor = output_processor
        self.admission = admission
        self.client = client
        self.slots: dict[str, RequestSlot] = {}  # user request id -> its stream's slot
        self.tokens_out = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens) per batch

    async def route(self, batch: EngineCoreOutputs) -> None:
        if batch.lost_req_ids:
            self.fail_lost(batch.lost_req_ids, batch.lost_reason)
        for rid in self.output_processor.record_started(batch.started):  # no longer queued
            self.admission.remove(rid)
        core_outputs = batch.outputs
        if not core_outputs:
            return
        self.tokens_out += sum(len(c.new_token_ids) for c in core_outputs)
        self._recent.append((time.monotonic(), self.tokens_out))
        processed = self.output_processor.process(core_outputs, batch.weights_version)
        if processed.to_abort:
            self.client.abort_requests(processed.to_abort)
        for rid, err in processed.failed:  # that request alone fails; the engine goes on
            log.warning("request %s failed: %s", rid, err, exc_info=err.__cause__)
            self.admission.remove(rid)
            slot = self.slots.pop(rid, None)
            if slot is not None:
                slot.put_error(err)
        for i, out in enumerate(processed.outputs):
            slot = self.slots.get(out.request_id)
            if slot is not None:
                slot.put(out)
                if out.finished:
                    del self.slots[out.request_id]
                    self.client.request_finished(out.request_id)
            if i % 256 == 255:
                await asyncio.sleep(0)  # let the app breathe between chunks of a big batch

    def end_aborted(self, rid: str) -> None:
        """The core has aborted ``rid``: its stream gets its last output (finish_reason "abort")."""
        self.admission.remove(rid)
        state = self.output_processor.abort(rid)
        slot = self.slots.pop(rid, None)
        if slot is not None and not slot.finished:
            slot.put(self.aborted_output(rid, state))

    def aborted_output(self, rid: str, state=None) -> RequestOutput:
        """The last output of an aborted stream: what it had (every sample "abort"), if known."""
        if state is not None:
            return self.output_processor.make_output(state)
        return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[],
                             outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")],
                             finished=True)

    def fail_request(self, rid: str, exc: Exception, stage: str) -> None:
        """That request alone fails (its input broke something): the core drops it, its stream
        raises RequestFailedError."""
        log.warning("request %s failed while it %s: %s: %s", rid, stage, type(exc).__name__, exc, exc_info=exc)
        self.client.abort_requests([rid])
        self.output_processor.abort(rid)
        self.admission.remove(rid)
        err = RequestFailedError(f"request {rid!r} failed while it {stage}: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        slot = self.slots.pop(rid, None)
        if slot is not None:
            slot.put_error(err)

    def fail_lost(self, core_req_ids: list[str], reason: str) -> None:
        """Requests a dead data-parallel core held fail with EngineCoreDied; the other cores go on
        (engine/dp_health.py)."""
        for crid in core_req_ids:
            rid = self.output_processor.request_id_of(crid)
            self.output_processor.abort(rid)
            self.admission.remove(rid)
            slot = self.slots.pop(rid, None)
            if slot is not None and not slot.finished:
                slot.put_error(EngineCoreDied(f"request {rid!r} was on {reason}; the other cores go on: retry it"))

    def abandon_all(self) -> None:
        """End every stream with an "abort" output and forget every request (the engine leaves its
        event loop; the caller empties the core)."""
        for slot in self.slots.values():
            if not slot.finished:
                try:
                    slot.put(self.aborted_output(slot.request_id))
                except RuntimeError:  # its loop is closed: nobody can read it anyway
                    pass
        for rid in list(self.output_processor.states):
            self.output_processor.abort(rid)
        self.slots.clear()
        self.admission.clear()

    def fail_all(self, dead: EngineDeadError) -> None:
        for slot in self.slots.values():
            slot.put_error(dead)
        self.slots.clear()
        self.admission.clear()

    def tokens_per_s(self) -> float:
        """Output tokens per second over the last batches (0 when none came in the last 5 s)."""
        if len(self._recent) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._recent[0], self._recent[-1]
        return (n1 - n0) / (t1 - t0) if time.monotonic() - t1 < 5.0 and t1 > t0 else 0.0
