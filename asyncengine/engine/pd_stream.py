"""One P/D request as one stream: its prompt on a prefill core (a one-token request whose only
use is the KV it leaves in the transfer), then the request itself on a decode core, which streams.

Behaves as ``RequestStream``: leaving early in any way (break, ``aclose()``, cancelling the
consuming task, dropping it) aborts the request on whichever core has it, and discards its transfer
if the decode core has not claimed it. An abort that lands between the two phases (the prefill core
finished, the decode core not yet asked) ends the stream there with ``finish_reason="abort"``. The
decode core's outputs carry the arrival time of the prefill request, so that time to first token
counts the hop.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import msgspec

from asyncengine.outputs import RequestMetrics, RequestOutput
from asyncengine.sampling_params import OutputKind, SamplingParams

if TYPE_CHECKING:
    from asyncengine.engine.protocol import EngineClient

# what the prefill core is asked: its one token is never used (the decode core samples the first)
PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0, output_kind=OutputKind.FINAL_ONLY)


def aborted(out: RequestOutput, n: int) -> RequestOutput:
    """The final output of a request aborted before its decode began: every sample empty."""
    c = out.outputs[0]
    empty = [msgspec.structs.replace(c, index=i, text="", token_ids=[], finish_reason="abort", stop_reason=None,
                                     logprobs=None, cumulative_logprob=None) for i in range(n)]
    return msgspec.structs.replace(out, outputs=empty, finished=True, text_delta="", token_ids_delta=[])


class PDStream:
    def __init__(self, request_id: str, prompt, params: SamplingParams, kw: dict,
                 prefill: "EngineClient | None", decode: "EngineClient", load: dict[int, int],
                 on_close: Callable[["PDStream", bool], None], source: str | None = None) -> None:
        """``prefill`` None: the prompt skips the hop (the decode core computes it). Submits now,
        so that a bad request raises here, as ``AsyncLLMEngine.generate`` does. ``load``: requests in
        flight per core (by ``id``), kept up to date; ``on_close(stream, finished)``: the stream
        ended, ``finished`` False when its transfer may be left unclaimed. ``source``: the prefill
        core's transfer address (tcp transport), passed to the decode core with the request."""
        self._load, self._on_close = load, on_close
        self.source = source
        self.request_id = request_id
        self._prompt, self._params, self._kw = prompt, params, kw
        self._decode = decode
        self._hop = prefill is not None
        self._engine = prefill if prefill is not None else decode
        self._inner = self._engine.generate(prompt, PREFILL_ONLY if self._hop else params,
                                            request_id=request_id, **kw)
        load[id(self._engine)] += 1
        self._prefill_metrics: RequestMetrics | None = None  # the prefill phase's (its arrival, its first step)
        self._abort_requested = False
        self._done = False
        self.closed_in_prefill = False

    @property
    def phase(self) -> str:
        return "done" if self._done else "prefill" if self._hop else "decode"

    def __aiter__(self) -> "PDStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            while True:
                out = await self._inner.__anext__()
                if self._hop:
                    if not out.finished:
                        continue
                    out = self._prefilled(out)
                    if out is None:
                        continue  # now on the decode core
                elif self._prefill_metrics is not None and out.metrics is not None:
                    # the request's own times: it arrived, and was first scheduled, on the prefill core
                    pm = self._prefill_metrics
                    out = msgspec.structs.replace(out, metrics=msgspec.structs.replace(
                        out.metrics, arrival_time=pm.arrival_time, first_scheduled_time=pm.first_scheduled_time))
                if out.finished:  # on the decode core (its transfer claimed), or aborted between the phases
                    self._close(finished=self._engine is not None)
                return out
        except BaseException:
            self._close(finished=False)
            raise

    def _prefilled(self, out: RequestOutput) -> RequestOutput | None:
        """The prefill core is done with the request: hand it to the decode core (None), or end
        the stream here if it was aborted meanwhile (the final output)."""
        self._load[id(self._engine)] -= 1
        self._hop = False
        self._prefill_metrics = out.metrics
        if self._abort_requested or out.outputs[0].finish_reason == "abort":
            self._engine = None
            return aborted(out, self._params.n)
        self._engine = self._decode
        self._inner = self._decode.generate(self._prompt, self._params, request_id=self.request_id, **self._kw,
                                            kv_transfer_params={"source": self.source} if self.source else None)
        self._load[id(self._engine)] += 1
        return None

    async def abort(self) -> None:
        """``PDEngine.abort``: abort it where it is now (its stream then ends with "abort")."""
        self._abort_requested = True
        if not self._done and self._engine is not None:
            await self._engine.abort(self.request_id)

    def _close(self, finished: bool) -> None:
        if self._done:
            return
        self._done = True
        self.closed_in_prefill = self._hop
        self._inner.close()  # aborts it on its core unless it finished there
        if self._engine is not None:
            self._load[id(self._engine)] -= 1
        self._on_close(self, finished)

    async def aclose(self) -> None:
        self._close(finished=False)

    def close(self) -> None:
        self._close(finished=False)

    def __del__(self) -> None:
        try:
            self._close(finished=False)
        except Exception:
            pass
