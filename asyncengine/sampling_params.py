"""SamplingParams: how one request is decoded. Same names and meanings as vLLM / the OpenAI API.

A msgspec Struct so it crosses process boundaries cheaply; validated in ``__post_init__`` so a bad
value fails the request that carries it, with a message naming the field.

The sampling knobs and ``max_tokens`` default to ``UNSET``, not to a number: a field the caller
leaves out is filled from the model's defaults by the front end (models/sampling_defaults.py,
applied once by the engine's InputProcessor), so ``SamplingParams(max_tokens=64)`` in Python
decodes as the server and the CLI do.
"""
from __future__ import annotations

import enum

import msgspec
from msgspec import UNSET, UnsetType

from asyncengine.errors import InvalidRequestError
from asyncengine.pooling_params import PoolingSpec
from asyncengine.structured_params import StructuredOutputsParams


class OutputKind(enum.IntEnum):
    """What a stream yields: only the new tokens, everything so far, or one final output."""

    DELTA = 0
    CUMULATIVE = 1
    FINAL_ONLY = 2


# the fields a caller may leave unset, filled from the model's defaults (models/sampling_defaults.py)
DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "max_tokens")
# the sampling knobs a caller picks (max_tokens is not a knob: it bounds the answer)
SAMPLING_KNOBS = tuple(f for f in DEFAULTED_FIELDS if f != "max_tokens")

# The engine's default of each of them, for a model whose generation config names no sampling.
# Why: the small chat models this engine targets (SmolLM2-135M by default) ramble at temperature
# 1.0 ("Éléments à Noël is the capital of France"), and even at temperature 0.2 with top_p 0.9 four
# of six seeds answered "What is the capital of France?" in made-up French (the first token is
# nearly a tie); a repetition penalty of 1.1 derails it the same way, because it also penalizes the
# prompt's words. Greedy decoding answers correctly but can loop on one sentence in long answers; a
# presence penalty (output tokens only, a flat 0.3 off every token already written) pushes away from
# verbatim loops without touching the words the prompt asks about. So: greedy plus a presence
# penalty, deterministic. ``max_tokens=None``: until EOS or the context is full (front ends say
# when an answer was cut).
ENGINE_DEFAULTS: dict = {
    "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.3, "frequency_penalty": 0.0, "max_tokens": None,
}


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How one request is decoded (vLLM's fields and meanings; see worker/sampler.py for the order
    in which the logits processors apply).

    * ``n``: parallel samples of the same prompt, returned as ``RequestOutput.outputs[i]``. They
      share the prompt's KV blocks (one prefill when prefix caching is on). With a ``seed``,
      sample ``i`` uses ``seed + i`` (so it equals an ``n=1`` request with that seed).
    * ``seed``: a seeded request's tokens depend only on the seed, the logits, and the output
      position: the same in any batch, order or slot.
    * ``logprobs=k``: per generated token, a dict ``{token_id: Logprob(logprob, rank,
      decoded_token)}`` holding the sampled token and the ``k`` most likely ones (``0``: the
      sampled one only); ``rank`` is 1-based. ``cumulative_logprob`` sums the sampled ones.
    * ``prompt_logprobs=k``: the same per prompt token (``None`` for the first one, which has no
      context); requests asking for them bypass the prefix cache (every position is computed).
    * Both are the model's RAW log-probabilities, ``log_softmax(logits)``, taken before
      temperature, penalties, logit bias, bans and top-k/top-p/min-p (vLLM's default
      ``logprobs_mode="raw_logprobs"``).
    * ``stop``: strings that end the sample; never streamed, cut from the text (kept with
      ``include_stop_str_in_output``); ``stop_reason`` is the string. ``stop_token_ids``: token ids
      that end it (``stop_reason`` is the id; its text is not in the output unless
      ``include_stop_str_in_output``). Neither, nor EOS, can end it before ``min_tokens`` tokens;
      ``ignore_eos`` ignores EOS (not ``stop_token_ids``).

    * Fields left ``UNSET`` (the knobs of :data:`DEFAULTED_FIELDS`) take the model's defaults
      when the engine takes the request (models/sampling_defaults.py): its generation config, then
      the engine's table; ``max_tokens=None`` means "until EOS or the context is full".

    Out-of-range values raise ``InvalidRequestError`` naming the field.
    """

    n: int = 1
    temperature: float | UnsetType = UNSET
    top_p: float | UnsetType = UNSET
    top_k: int | UnsetType = UNSET  # 0 or -1 = disabled
    min_p: float | UnsetType = UNSET
    repetition_penalty: float | UnsetType = UNSET
    presence_penalty: float | UnsetType = UNSET
    frequency_penalty: float | UnsetType = UNSET
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    seed: int | None = None
    max_tokens: int | None | UnsetType = UNSET
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: OutputKind = OutputKind.CUMULATIVE
    detokenize: bool = True
    # constrained decoding (vLLM's shape): StructuredOutputsParams(json=schema | json_object=True |
    # regex=... | choice=[...] | grammar=ebnf)
    structured_outputs: StructuredOutputsParams | None = None
    # a pooling (embedding) request: its prompt's final hidden states pooled into
    # RequestOutput.embedding (engine.embed sets it, with max_tokens=1: it never decodes)
    pooling: PoolingSpec | None = None

    def __post_init__(self) -> None:
        check_sampling_ranges(self)

    @property
    def greedy(self) -> bool:
        return self.temperature is not UNSET and self.temperature < 1e-5

    @property
    def resolved(self) -> bool:
        """Whether every defaulted field has a value (the engine's layers below the front end
        only ever see resolved params)."""
        return all(getattr(self, f) is not UNSET for f in DEFAULTED_FIELDS)

    @property
    def needs_every_prompt_row(self) -> bool:
        """Whether every prompt position must be computed here (no prefix-cache hit): prompt
        logprobs, or mean / cls pooling (last-token pooling needs only the last, always computed)."""
        return self.prompt_logprobs is not None or (self.pooling is not None and self.pooling.pooling != "last")

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


def check_sampling_ranges(p: SamplingParams) -> None:
    """The value ranges of SamplingParams' fields, checked when one is built (normalizes ``stop``
    to a list and ``top_k=-1`` to 0). Out-of-range values raise InvalidRequestError naming the field."""
    def bad(msg: str) -> None:
        raise InvalidRequestError(f"SamplingParams: {msg}")

    def given(v) -> bool:
        return v is not UNSET

    if p.n < 1:
        bad(f"n must be >= 1, got {p.n}")
    if given(p.temperature) and not p.temperature >= 0.0:
        bad(f"temperature must be >= 0, got {p.temperature}")
    if given(p.top_p) and not 0.0 < p.top_p <= 1.0:
        bad(f"top_p must be in (0, 1], got {p.top_p}")
    if given(p.top_k) and p.top_k < -1:
        bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {p.top_k}")
    if given(p.top_k) and p.top_k == -1:
        p.top_k = 0
    if given(p.min_p) and not 0.0 <= p.min_p <= 1.0:
        bad(f"min_p must be in [0, 1], got {p.min_p}")
    if given(p.repetition_penalty) and not p.repetition_penalty > 0.0:
        bad(f"repetition_penalty must be > 0, got {p.repetition_penalty}")
    if given(p.presence_penalty) and not -2.0 <= p.presence_penalty <= 2.0:
        bad(f"presence_penalty must be in [-2, 2], got {p.presence_penalty}")
    if given(p.frequency_penalty) and not -2.0 <= p.frequency_penalty <= 2.0:
        bad(f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}")
    if given(p.max_tokens) and p.max_tokens is not None and p.max_tokens < 1:
        bad(f"max_tokens must be >= 1, got {p.max_tokens}")
    if p.min_tokens < 0:
        bad(f"min_tokens must be >= 0, got {p.min_tokens}")
    if given(p.max_tokens) and p.max_tokens is not None and p.min_tokens > p.max_tokens:
        bad(f"min_tokens ({p.min_tokens}) must be <= max_tokens ({p.max_tokens})")
    if p.logprobs is not None and p.logprobs < 0:
        bad(f"logprobs must be >= 0, got {p.logprobs}")
    if p.prompt_logprobs is not None and p.prompt_logprobs < 0:
        bad(f"prompt_logprobs must be >= 0, got {p.prompt_logprobs}")
    if p.pooling is not None:  # a bad spec would reach the worker otherwise
        p.pooling.validated()
    if isinstance(p.stop, str):
        p.stop = [p.stop]
    if p.stop is not None and any(not s for s in p.stop):
        bad("stop strings must be non-empty")
    if p.allowed_token_ids is not None and not p.allowed_token_ids:
        bad("allowed_token_ids must not be empty")
    if p.seed is not None and not (0 <= p.seed < 2**63):
        bad(f"seed must be in [0, 2**63), got {p.seed}")


def resolve_unset(params: SamplingParams, defaults: dict = ENGINE_DEFAULTS) -> SamplingParams:
    """``params`` with each unset field taken from ``defaults`` (every key of DEFAULTED_FIELDS,
    range-checked already); the same object when nothing is unset. The one coupling: a presence
    penalty the caller did not set comes only with the default sampling; a caller who picks any
    knob (``temperature=0`` for plain greedy, say) gets no penalty it did not ask for."""
    missing = {f: defaults[f] for f in DEFAULTED_FIELDS if getattr(params, f) is UNSET}
    if "presence_penalty" in missing and any(getattr(params, f) is not UNSET for f in SAMPLING_KNOBS):
        missing["presence_penalty"] = 0.0
    return msgspec.structs.replace(params, **missing) if missing else params
