"""What the engine gives back: the same shape as vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

import msgspec


class Logprob(msgspec.Struct, array_like=True):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# position -> {token id: Logprob}; one dict per generated (or prompt) token
SampleLogprobs = list[dict[int, Logprob]]


class RequestMetrics(msgspec.Struct, kw_only=True):
    """When a request went through each stage (``time.monotonic()``, one clock for every process
    on the machine), and what it cost: queue time = first_scheduled_time - arrival_time, TTFT =
    first_token_time - arrival_time. With ``n > 1``, the first sample's times and the most preempted
    sample's count."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


class CompletionOutput(msgspec.Struct, kw_only=True):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    # per token of token_ids: the weights_version that produced it (a request kept through a
    # pause_generation("keep") and an update_weights may span versions)
    weights_versions: list[int] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: SampleLogprobs | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # what is new since the previous output of this request's stream (first sample only; the
    # per-sample deltas live in outputs[i] when output_kind is DELTA)
    text_delta: str = ""
    token_ids_delta: list[int] = []
    # the weights (0 as loaded, +1 per update_weights) that produced this output's newest tokens
    weights_version: int = 0
    # a pooling request's embedding (SamplingParams.pooling), once its prompt has run
    embedding: list[float] | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""
