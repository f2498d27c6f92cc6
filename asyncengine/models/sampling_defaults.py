"""One set of sampling defaults for every front end (CLI, server, web page, ``generate()`` without
params): the model's own generation config when it has one (as ``vllm serve --generation-config
auto``), else :data:`SMALL_CHAT_DEFAULTS`. ``SamplingParams()`` itself keeps vLLM's field defaults.
The defaults are a set: a front end uses them when the caller picked none of the sampling knobs
(temperature, top_p, top_k, min_p, penalties); a caller who picks one gets SamplingParams' field
defaults for the rest (no penalty it did not ask for).

Why these values: the small chat models this engine targets (SmolLM2-135M by default) ramble at
temperature 1.0 ("Éléments à Noël is the capital of France"), and even at temperature 0.2 with
top_p 0.9 four of six seeds answered "What is the capital of France?" in made-up French (the
first token is nearly a tie); a repetition penalty of 1.1 derails it the same way, because it also
penalizes the prompt's words. Greedy decoding answers correctly but can loop on one sentence in
long answers; a presence penalty (output tokens only, a flat 0.3 off every token already written)
pushes away from verbatim loops without touching the words the prompt asks about. So: greedy plus
a presence penalty, deterministic. ``max_tokens=None`` means "until EOS or the context is full"
(front ends say when an answer was cut).
"""
from __future__ import annotations

from typing import Any

from asyncengine.sampling_params import SamplingParams

SMALL_CHAT_DEFAULTS: dict[str, Any] = {"temperature": 0.0, "presence_penalty": 0.3, "max_tokens": None}

# generation_config.json keys -> SamplingParams fields (the ones that are sampling settings)
_GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                             "repetition_penalty": "repetition_penalty"}


def default_sampling_params(generation_config: dict | None) -> SamplingParams:
    """The front ends' defaults for a model whose generation config is ``generation_config``
    (the parsed generation_config.json, or sampling keys from GGUF metadata; None: none)."""
    fields = dict(SMALL_CHAT_DEFAULTS)
    if generation_config:
        own = {f: generation_config[k] for k, f in _GENERATION_CONFIG_FIELDS.items()
               if generation_config.get(k) is not None}
        if generation_config.get("do_sample") is False:  # the model asks for greedy decoding
            own["temperature"] = 0.0
        if own:  # the model's own choice replaces ours as a whole, as vLLM does
            fields = {"max_tokens": None, **own}
    return SamplingParams(**fields)


SAMPLING_KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")


def with_defaults(defaults: SamplingParams, knobs: dict[str, Any], **fields: Any) -> SamplingParams:
    """SamplingParams for a front end's call: the caller's sampling knobs (None = not set), or, when
    it set none of them, ``defaults``' knobs as a set; ``fields`` (max_tokens, stop, ...) as given."""
    chosen = {k: v for k, v in knobs.items() if k in SAMPLING_KNOBS and v is not None}
    if not chosen:
        chosen = {k: getattr(defaults, k) for k in SAMPLING_KNOBS}
    return SamplingParams(**chosen, **fields)


def gguf_generation_config(metadata: dict) -> dict | None:
    """Sampling settings a GGUF file carries (``general.sampling.*``, written by recent llama.cpp
    converters from the model's generation_config.json), under generation_config.json's names."""
    keys = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
            "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
            "general.sampling.penalty_repeat": "repetition_penalty"}
    found = {name: metadata[k] for k, name in keys.items() if metadata.get(k) is not None}
    return found or None
