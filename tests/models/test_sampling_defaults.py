"""The one rule for sampling defaults: a field the caller sets is used as given; an unset one comes
from the model's generation config, then from the engine's table (sampling_params.ENGINE_DEFAULTS)."""
from __future__ import annotations

import msgspec
import pytest

from asyncengine.errors import InvalidRequestError
from asyncengine.models.sampling_defaults import (default_sampling_params, gguf_generation_config, model_defaults,
                                                  resolve, sampling_params_from)
from asyncengine.sampling_params import DEFAULTED_FIELDS, ENGINE_DEFAULTS, SamplingParams, resolve_unset


def test_unset_fields_are_distinguishable_and_survive_the_wire():
    p = SamplingParams(max_tokens=64)
    assert all(getattr(p, f) is msgspec.UNSET for f in DEFAULTED_FIELDS if f != "max_tokens")
    assert not p.resolved and not p.greedy
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert back == p


def test_the_engine_table_fills_what_a_model_without_a_config_leaves():
    r = resolve(SamplingParams(max_tokens=64), model_defaults(None))
    assert r.resolved and r.max_tokens == 64
    assert {f: getattr(r, f) for f in DEFAULTED_FIELDS if f != "max_tokens"} == \
        {f: v for f, v in ENGINE_DEFAULTS.items() if f != "max_tokens"}
    assert resolve(SamplingParams(), model_defaults(None)).max_tokens is None  # until EOS or the context is full


def test_a_field_the_caller_sets_is_used_as_given_and_the_rest_are_filled_one_by_one():
    d = model_defaults({"temperature": 0.7, "top_p": 0.8, "top_k": 20})
    r = resolve(SamplingParams(temperature=1.0, presence_penalty=0.0, max_tokens=None), d)
    assert (r.temperature, r.top_p, r.top_k, r.presence_penalty, r.max_tokens) == (1.0, 0.8, 20, 0.0, None)
    r = resolve(SamplingParams(temperature=0.0), d)
    assert (r.temperature, r.top_p) == (0.0, 0.8)  # temperature 0 is a value, not "unset"


def test_the_loop_penalty_comes_only_with_the_default_sampling():
    """A caller who picks a knob (temperature=0: plain greedy, as the parity tests ask for) gets
    no presence penalty it did not ask for; one who picks none gets the engine's greedy + 0.3."""
    d = model_defaults(None)
    assert resolve(SamplingParams(max_tokens=8), d).presence_penalty == ENGINE_DEFAULTS["presence_penalty"] > 0
    assert resolve(SamplingParams(temperature=0.0), d).presence_penalty == 0.0
    assert resolve(SamplingParams(top_k=5), d).presence_penalty == 0.0
    assert resolve(SamplingParams(temperature=0.0, presence_penalty=0.5), d).presence_penalty == 0.5
    assert resolve_unset(SamplingParams(temperature=0.0)).presence_penalty == 0.0  # the core's own fill too


def test_a_models_own_sampling_replaces_the_engines_loop_penalty():
    own = model_defaults({"temperature": 0.6, "top_p": 0.95, "eos_token_id": 2})
    assert (own["temperature"], own["top_p"], own["presence_penalty"], own["max_tokens"]) == (0.6, 0.95, 0.0, None)
    assert model_defaults({"do_sample": False})["temperature"] == 0.0
    assert model_defaults({"eos_token_id": 2}) == ENGINE_DEFAULTS  # no sampling keys: the table
    assert model_defaults({"top_k": -1})["top_k"] == 0  # normalized once, at load
    with pytest.raises(InvalidRequestError, match="top_p"):
        model_defaults({"top_p": 1.5})
    assert default_sampling_params(None) == SamplingParams(**ENGINE_DEFAULTS)


def test_front_end_options_none_means_unset():
    p = sampling_params_from(temperature=None, top_p=0.5, max_tokens=None, stop=None, seed=None)
    assert p.temperature is msgspec.UNSET and p.max_tokens is msgspec.UNSET and p.top_p == 0.5


def test_gguf_sampling_metadata():
    assert gguf_generation_config({"general.sampling.temp": 0.3, "general.sampling.top_k": 40}) == \
        {"temperature": 0.3, "top_k": 40}
    assert gguf_generation_config({"general.name": "x"}) is None


def test_a_core_request_made_without_a_front_end_gets_the_table():
    from asyncengine.core.request import Request

    r = Request("r", [1, 2], SamplingParams(max_tokens=4), max_tokens=4)
    assert r.sampling_params.resolved and r.sampling_params.temperature == ENGINE_DEFAULTS["temperature"]
