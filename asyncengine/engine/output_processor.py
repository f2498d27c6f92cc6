"""Output processing: core outputs (token ids) in, user-facing ``RequestOutput``s out.

Per sample it keeps an incremental detokenizer and a stop-string matcher, so text is decoded
once, incrementally, and no part of a stop string is ever streamed. A stop-string match finishes
the sample here; the caller must abort it in the core (its core id is in
``ProcessedOutputs.to_abort``).

Text convention (vLLM's): a completion's text is what its tokens add *after the prompt*, i.e.
``decode(prompt + output)[len(decode(prompt)):]``; the detokenizer is primed with the prompt's last
tokens (``IncrementalDetokenizer(..., prompt_context=True)``). For SentencePiece-style tokenizers
(Llama 2, Mistral, Gemma) this keeps the leading space that ``decode(output_ids)`` alone drops
(``" Paris"``, not ``"Paris"``), so ``prompt + text`` reads right; for byte-level BPE tokenizers
(GPT-2, Llama 3, Qwen, SmolLM...) it is exactly ``decode(output_ids)``. Either way the streamed
text deltas concatenate to the final ``text``.

A sample ended by EOS or one of ``stop_token_ids`` keeps that token in ``token_ids`` but not its
text in ``text``, unless ``include_stop_str_in_output`` (vLLM's rule); a stop *string* cuts the
text before it (or after it, with ``include_stop_str_in_output``) and is never streamed.

Parallel samples (``n > 1``): the core runs one request per sample, ids
``child_request_id(request_id, i)``; here they are gathered into ONE ``RequestOutput`` per user
request, with ``outputs[i]`` (``index == i``) per sample, finished when every sample is. What an
output carries follows ``output_kind``:

* ``CUMULATIVE``: all ``n`` samples, everything so far.
* ``DELTA``: only the samples that changed since the previous output, each with its new tokens and
  text (``CompletionOutput.index`` says which); ``prompt_logprobs`` only in the first output.
* ``FINAL_ONLY``: one output, once every sample has finished.

``RequestOutput.text_delta`` / ``token_ids_delta`` are sample 0's news since the previous output.
Prompt logprobs arrive chunk by chunk (chunked prefill); they are assembled here and shown once
complete (``[None, {...}, ...]``: one entry per prompt token, the first has none), which is at the
latest with sample 0's first token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from asyncengine.core.request import child_request_id
from asyncengine.contracts.sched_output import EngineCoreOutput
from asyncengine.engine.detokenizer import IncrementalDetokenizer
from asyncengine.engine.stop_strings import StopAutomaton, StopStringMatcher
from asyncengine.errors import RequestFailedError
from asyncengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from asyncengine.sampling_params import OutputKind, SamplingParams


@dataclass
class SampleState:
    """One of the ``n`` samples of a request (the only one when ``n == 1``)."""

    index: int
    core_id: str
    detokenizer: IncrementalDetokenizer | None
    stops: StopStringMatcher | None
    token_ids: list[int] = field(default_factory=list)
    weights_versions: list[int] = field(default_factory=list)  # per token: the weights that made it
    text: str = ""
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # what the previous output showed (for deltas)
    sent_text: int = 0
    sent_finish: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def has_news(self) -> bool:
        return (len(self.token_ids) > self.sent_tokens or len(self.text) > self.sent_text
                or (self.finished and not self.sent_finish))


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[SampleState]
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    embedding: list[float] | None = None  # a pooling request's, once its prompt has run
    num_cached_tokens: int = 0
    weights_version: int = 0  # of the newest batch that brought this request tokens

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    to_abort: list[str]  # core ids finished here (a stop string, a failure): abort them in the core
    # user requests whose output handling raised (detokenizer, stop matching...): each fails alone
    # with this error, the others go on
    failed: list[tuple[str, RequestFailedError]] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # by user request id
        self._samples: dict[str, tuple[RequestState, SampleState]] = {}  # by core id
        self._weights_version = 0  # of the batch being processed

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    stop_automaton: StopAutomaton | None = None) -> RequestState:
        n = params.n
        want_lp = params.logprobs is not None
        samples = []
        # one automaton for every sample (linear in the stops' total length; validation bounds it)
        automaton = None
        if params.stop and self.tokenizer is not None and params.detokenize:
            automaton = stop_automaton if stop_automaton is not None else StopAutomaton(params.stop)
        for i in range(n):
            detok = stops = None
            if self.tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                               skip_special_tokens=params.skip_special_tokens,
                                               prompt_context=True)
                if automaton is not None:
                    stops = StopStringMatcher(automaton, params.include_stop_str_in_output)
            samples.append(SampleState(
                index=i, core_id=request_id if n == 1 else child_request_id(request_id, i),
                detokenizer=detok, stops=stops, logprobs=[] if want_lp else None,
                cumulative_logprob=0.0 if want_lp else None))
        st = RequestState(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                          params=params, metrics=RequestMetrics(arrival_time=arrival_time or time.monotonic()),
                          samples=samples,
                          # the first prompt token has no logprob
                          prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self.states[request_id] = st
        for s in samples:
            self._samples[s.core_id] = (st, s)
        return st

    def is_live(self, request_id: str) -> bool:
        """True while ``request_id`` is a live user request or a live sample's core id."""
        return request_id in self.states or request_id in self._samples

    def request_id_of(self, core_id: str) -> str:
        """The user request id of a core request id (itself when unknown or ``n == 1``)."""
        ref = self._samples.get(core_id)
        return ref[0].request_id if ref is not None else core_id

    def record_started(self, started: dict[str, float]) -> list[str]:
        """The core scheduled these (core id -> when) for the first time: their metrics'
        ``first_scheduled_time``; returns their user request ids (the admission queue lets them go)."""
        rids = []
        for core_id, when in started.items():
            rid = self.request_id_of(core_id)
            st = self.states.get(rid)
            if st is not None and st.metrics.first_scheduled_time is None:
                st.metrics.first_scheduled_time = when  # n > 1: the first sample's
            rids.append(rid)
        return rids

    def abort(self, request_id: str) -> RequestState | None:
        """Forget a user request; its unfinished samples end with finish_reason "abort"."""
        st = self.states.pop(request_id, None)
        if st is None:
            return None
        now = time.monotonic()
        for s in st.samples:
            self._samples.pop(s.core_id, None)
            if not s.finished:
                s.finish_reason = "abort"
        if st.metrics.finished_time is None:
            st.metrics.finished_time = now
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

    def process(self, core_outputs: list[EngineCoreOutput], weights_version: int = 0) -> ProcessedOutputs:
        """``weights_version``: the weights the batch of ``core_outputs`` ran on (its tokens carry it)."""
        self._weights_version = weights_version
        now = time.monotonic()
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        touched: dict[str, RequestState] = {}
        failed: list[tuple[str, RequestFailedError]] = []
        for co in core_outputs:
            ref = self._samples.get(co.req_id)
            if ref is None:
                continue
            st, s = ref
            if s.finished:
                continue
            touched[st.request_id] = st
            try:
                self._process_one(st, s, co, now, to_abort)
            except Exception as e:  # this request's fault (a detokenizer, a matcher...): it alone fails
                failed.append((st.request_id, self._fail(st, e, to_abort)))
                touched.pop(st.request_id, None)
        for st in touched.values():
            if st.finished:
                st.metrics.finished_time = now
                del self.states[st.request_id]
            elif st.params.output_kind == OutputKind.FINAL_ONLY:
                continue
            elif not any(s.has_news for s in st.samples):
                continue  # e.g. a prefill chunk that only brought prompt logprobs
            try:
                results.append(self.make_output(st))
            except Exception as e:
                failed.append((st.request_id, self._fail(st, e, to_abort)))
        return ProcessedOutputs(results, to_abort, failed)

    def _fail(self, st: RequestState, exc: Exception, to_abort: list[str]) -> RequestFailedError:
        """Forget a request whose output handling raised; its unfinished samples are aborted."""
        for s in st.samples:
            if not s.finished:
                to_abort.append(s.core_id)
        self.abort(st.request_id)
        err = RequestFailedError(f"request {st.request_id!r} failed while its output was processed: "
                                 f"{type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err

    def _process_one(self, st: RequestState, s: SampleState, co: EngineCoreOutput, now: float,
                     to_abort: list[str]) -> None:
        m = st.metrics
        new_ids = co.new_token_ids
        if new_ids:
            s.weights_versions.extend([self._weights_version] * len(new_ids))
            st.weights_version = self._weights_version
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
        m.num_preemptions = max(m.num_preemptions, co.num_preemptions)  # n > 1: its most preempted sample
        if s.index == 0:
            st.num_cached_tokens = co.num_cached_tokens
        if co.pooled is not None:
            st.embedding = co.pooled
        if co.new_prompt_logprobs and st.prompt_logprobs is not None:
            st.prompt_logprobs.extend(self._decode_logprobs(e) for e in co.new_prompt_logprobs)
        s.token_ids.extend(new_ids)
        if co.new_logprobs and s.logprobs is not None:
            for entry in co.new_logprobs:
                s.logprobs.append(self._decode_logprobs(entry))
                s.cumulative_logprob += entry[1][0]
        finish, stop_reason = co.finish_reason, co.stop_reason
        if s.detokenizer is not None:
            text_ids = new_ids
            if co.finish_reason == "stop" and new_ids and not st.params.include_stop_str_in_output:
                text_ids = new_ids[:-1]  # the EOS / stop token that ended it is not text (vLLM)
            delta = s.detokenizer.push(text_ids)
            if finish is not None:
                delta += s.detokenizer.finish()  # an unfinished character at the very end
            if s.stops is not None:
                delta, matched = s.stops.feed(delta)
                if matched is not None:
                    finish, stop_reason = "stop", matched
                    if co.finish_reason is None:
                        to_abort.append(co.req_id)
                elif finish is not None:
                    delta += s.stops.flush()
            s.text += delta
        if finish is not None:
            s.finish_reason, s.stop_reason = finish, stop_reason
            del self._samples[co.req_id]

    def make_output(self, st: RequestState) -> RequestOutput:
        """The output as the request's output_kind wants it, with the deltas since the last one."""
        delta_kind = st.params.output_kind == OutputKind.DELTA
        comps = []
        for s in st.samples:
            if delta_kind and not s.has_news:
                continue
            if delta_kind:
                text, ids = s.text[s.sent_text:], s.token_ids[s.sent_tokens:]
                versions = s.weights_versions[s.sent_tokens:]
                lps = s.logprobs[s.sent_tokens:] if s.logprobs is not None else None
            else:
                text, ids, versions = s.text, list(s.token_ids), list(s.weights_versions)
                lps = list(s.logprobs) if s.logprobs is not None else None
            comps.append(CompletionOutput(index=s.index, text=text, token_ids=ids, finish_reason=s.finish_reason,
                                          stop_reason=s.stop_reason, logprobs=lps,
                                          cumulative_logprob=s.cumulative_logprob, weights_versions=versions))
        s0 = st.samples[0]
        text_delta, ids_delta = s0.text[s0.sent_text:], s0.token_ids[s0.sent_tokens:]
        for s in st.samples:
            s.sent_text, s.sent_tokens = len(s.text), len(s.token_ids)
            s.sent_finish = s.finished
        prompt_lps = st.prompt_logprobs
        if prompt_lps is not None and len(prompt_lps) < len(st.prompt_token_ids):
            prompt_lps = None  # still arriving (another sample may be ahead of sample 0's prefill)
        if delta_kind:
            prompt_lps = None if st.prompt_logprobs_sent else prompt_lps
            st.prompt_logprobs_sent = st.prompt_logprobs_sent or prompt_lps is not None
        st.metrics.num_cached_tokens = st.num_cached_tokens
        return RequestOutput(request_id=st.request_id, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
                             outputs=comps, finished=st.finished, prompt_logprobs=prompt_lps,
                             metrics=st.metrics, num_cached_tokens=st.num_cached_tokens,
                             text_delta=text_delta, token_ids_delta=ids_delta,
                             weights_version=st.weights_version, embedding=st.embedding)
