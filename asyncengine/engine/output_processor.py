"""Output processing: core outputs (token ids) in, user-facing ``RequestOutput``s out.

Per request it keeps an incremental detokenizer and a stop-string matcher, so text is decoded
once, incrementally, and no part of a stop string is ever streamed. A stop-string match finishes
the request here; the caller must abort it in the core (returned in ``ProcessedOutputs.to_abort``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from asyncengine.core.sched_output import EngineCoreOutput
from asyncengine.engine.detokenizer import IncrementalDetokenizer
from asyncengine.engine.stop_strings import StopStringMatcher
from asyncengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from asyncengine.sampling_params import OutputKind, SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    stops: StopStringMatcher | None
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    sent_tokens: int = 0  # for DELTA outputs
    sent_text: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    to_abort: list[str]  # finished here by a stop string: abort them in the core


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None) -> RequestState:
        detok = None
        stops = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                           skip_special_tokens=params.skip_special_tokens)
            if params.stop:
                stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        st = RequestState(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                          params=params, detokenizer=detok, stops=stops,
                          metrics=RequestMetrics(arrival_time=arrival_time or time.monotonic()),
                          logprobs=[] if params.logprobs is not None else None,
                          cumulative_logprob=0.0 if params.logprobs is not None else None)
        self.states[request_id] = st
        return st

    def abort(self, request_id: str) -> RequestState | None:
        st = self.states.pop(request_id, None)
        if st is not None and not st.finished:
            st.finish_reason = "abort"
        return st

    def _decode_logprobs(self, entry) -> dict[int, Logprob]:
        ids, vals, rank = entry
        out: dict[int, Logprob] = {}
        for j, (tid, v) in enumerate(zip(ids, vals)):
            if tid in out:
                continue
            dec = self.tokenizer.decode([tid]) if self.tokenizer is not None else None
            out[tid] = Logprob(logprob=v, rank=rank if j == 0 else j, decoded_token=dec)
        return out

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.monotonic()
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        for co in core_outputs:
            st = self.states.get(co.req_id)
            if st is None or st.finished:
                continue
            m = st.metrics
            if m.first_token_time is None and co.new_token_ids:
                m.first_token_time = now
            m.last_token_time = now
            st.num_cached_tokens = co.num_cached_tokens
            new_ids = co.new_token_ids
            st.token_ids.extend(new_ids)
            if co.new_logprobs and st.logprobs is not None:
                for entry in co.new_logprobs:
                    st.logprobs.append(self._decode_logprobs(entry))
                    st.cumulative_logprob += entry[1][0]
            if co.new_prompt_logprobs:
                if st.prompt_logprobs is None:
                    st.prompt_logprobs = [None]  # the first prompt token has no logprob
                st.prompt_logprobs.extend(self._decode_logprobs(e) for e in co.new_prompt_logprobs)
            finish, stop_reason = co.finish_reason, co.stop_reason
            if st.detokenizer is not None:
                delta = st.detokenizer.push(new_ids)
                if finish is not None:
                    delta += st.detokenizer.finish()  # an unfinished character at the very end
                if st.stops is not None:
                    delta, matched = st.stops.feed(delta)
                    if matched is not None:
                        finish, stop_reason = "stop", matched
                        if co.finish_reason is None:
                            to_abort.append(co.req_id)
                    elif finish is not None:
                        delta += st.stops.flush()
                st.text += delta
            if finish is not None:
                st.finish_reason, st.stop_reason = finish, stop_reason
                m.finished_time = now
                del self.states[co.req_id]
            if st.params.output_kind == OutputKind.FINAL_ONLY and not st.finished:
                continue
            results.append(self.make_output(st))
        return ProcessedOutputs(results, to_abort)

    def make_output(self, st: RequestState) -> RequestOutput:
        """The output as the request's output_kind wants it, with the delta since the last one."""
        text_delta = st.text[st.sent_text:]
        ids_delta = st.token_ids[st.sent_tokens:]
        if st.params.output_kind == OutputKind.DELTA:
            text, ids = text_delta, ids_delta
            lps = st.logprobs[st.sent_tokens:] if st.logprobs is not None else None
        else:
            text, ids = st.text, list(st.token_ids)
            lps = list(st.logprobs) if st.logprobs is not None else None
        st.sent_text, st.sent_tokens = len(st.text), len(st.token_ids)
        comp = CompletionOutput(index=0, text=text, token_ids=ids, finish_reason=st.finish_reason,
                                stop_reason=st.stop_reason, logprobs=lps,
                                cumulative_logprob=st.cumulative_logprob)
        st.metrics.num_cached_tokens = st.num_cached_tokens
        return RequestOutput(request_id=st.request_id, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
                             outputs=[comp], finished=st.finished, prompt_logprobs=st.prompt_logprobs,
                             metrics=st.metrics, num_cached_tokens=st.num_cached_tokens,
                             text_delta=text_delta, token_ids_delta=ids_delta)
