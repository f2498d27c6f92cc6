"""One rule for sampling defaults, for every front end (``LLM``, ``AsyncLLMEngine``, the CLI, the
server, the LangChain/LlamaIndex adapters): a field the caller sets is used as given; a field it
leaves unset (``UNSET`` in :class:`SamplingParams`) comes from the model's generation config
(generation_config.json, or the GGUF's ``general.sampling.*``), then from :data:`ENGINE_DEFAULTS`.
The engine's InputProcessor applies it, once per request (:func:`resolve`), so no front end
carries defaults of its own. (The table lives in sampling_params.py, with the fields, so that
the core can fill a request made without a front end, e.g. in tests, from the same table.)

A model whose generation config names its own sampling (Qwen's temperature 0.7, top_p 0.8, ...)
gets no loop penalty it did not ask for: the penalty belongs to our greedy choice (vLLM's
``--generation-config auto`` applies the model's values the same way, field by field).
"""
from __future__ import annotations

from typing import Any

from asyncengine.sampling_params import DEFAULTED_FIELDS, ENGINE_DEFAULTS, SamplingParams, resolve_unset

# generation_config.json keys -> SamplingParams fields (the ones that are sampling settings)
_GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                             "repetition_penalty": "repetition_penalty"}


def model_defaults(generation_config: dict | None) -> dict[str, Any]:
    """Every defaulted field's value for a model whose generation config is ``generation_config``
    (the parsed generation_config.json, or sampling keys from GGUF metadata; None: none)."""
    own: dict[str, Any] = {}
    if generation_config:
        own = {f: generation_config[k] for k, f in _GENERATION_CONFIG_FIELDS.items()
               if generation_config.get(k) is not None}
        if generation_config.get("do_sample") is False:  # the model asks for greedy decoding
            own["temperature"] = 0.0
    values = dict(ENGINE_DEFAULTS)
    if own:  # the loop penalty belongs to our greedy choice, not to the model's own sampling
        values.update(presence_penalty=0.0, **own)
    checked = SamplingParams(**values)  # range-checked once, at load (top_k=-1 -> 0)
    return {f: getattr(checked, f) for f in DEFAULTED_FIELDS}


def resolve(params: SamplingParams, defaults: dict[str, Any]) -> SamplingParams:
    """``params`` with each unset field taken from ``defaults`` (:func:`model_defaults`); the same
    object when nothing is unset (the defaults were range-checked when they were made)."""
    return resolve_unset(params, defaults)


def default_sampling_params(generation_config: dict | None) -> SamplingParams:
    """The model's defaults as one SamplingParams (what a request with no sampling fields decodes with)."""
    return SamplingParams(**model_defaults(generation_config))


def sampling_params_from(**fields: Any) -> SamplingParams:
    """SamplingParams from a front end's options where ``None`` means "not set" for the defaulted
    fields (flags, keyword arguments): those stay unset, for the engine to resolve."""
    return SamplingParams(**{k: v for k, v in fields.items() if not (k in DEFAULTED_FIELDS and v is None)})


def gguf_generation_config(metadata: dict) -> dict | None:
    """Sampling settings a GGUF file carries (``general.sampling.*``, written by recent llama.cpp
    converters from the model's generation_config.json), under generation_config.json's names."""
    keys = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
            "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
            "general.sampling.penalty_repeat": "repetition_penalty"}
    found = {name: metadata[k] for k, name in keys.items() if metadata.get(k) is not None}
    return found or None
