"""The OpenAI server's structured outputs: response_format json_object / json_schema, tools with
tool_choice auto / required / named giving tool_calls whose arguments validate, a schema that cannot
compile is a 400 naming the compiler's complaint, and the engine lives on."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from live_server import MODEL

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(client, **kw):
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=MODEL, messages=MSG, **kw)


def test_response_format(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                               "score": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["answer", "score"], "additionalProperties": False}
    for seed in range(4):
        r = chat(client, seed=seed, temperature=1.0,
                 response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        c = r.choices[0]
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)
    r = chat(client, temperature=0.0, response_format={"type": "json_object"}, max_tokens=200)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def _check_calls(calls):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_required_named_auto(client):
    for seed in range(3):
        r = chat(client, seed=seed, temperature=1.0, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        _check_calls(c.message.tool_calls)
    r = chat(client, temperature=0.0, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "add"
    _check_calls(c.message.tool_calls)
    # auto: the tiny random model answers in text; any tool call it made would have to validate
    r = chat(client, temperature=0.0, tools=TOOLS, tool_choice="auto", max_tokens=16)
    c = r.choices[0]
    if c.message.tool_calls:
        _check_calls(c.message.tool_calls)
    else:
        assert c.message.content is not None and c.finish_reason in ("stop", "length")


def test_bad_schema_is_400_and_engine_lives(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": 5}}})
    assert "does not compile" in str(e.value) and "properties" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError):
        chat(client, response_format={"type": "xml"})
    r = chat(client, temperature=0.0, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_earlier_tool_calls_reach_the_model(client):
    """An assistant turn's tool_calls are rendered into the prompt (as the model is asked to call),
    not dropped: the prompt is the one written with the calls as text. Bad calls are a 400."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    as_calls = MSG + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    as_text = MSG + [{"role": "assistant", "content": '[{"name": "add", "arguments": {"a": 1, "b": 2}}]'},
                     {"role": "tool", "content": "3"}]
    without = MSG + [{"role": "assistant", "content": None}, {"role": "tool", "content": "3"}]

    def prompt_tokens(messages):
        return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=1,
                                              temperature=0.0).usage.prompt_tokens

    assert prompt_tokens(as_calls) == prompt_tokens(as_text) > prompt_tokens(without)
    bad = [dict(call, function={"name": "add", "arguments": "{not json"})]
    with pytest.raises(openai.BadRequestError, match="arguments is not valid JSON"):
        prompt_tokens(MSG + [{"role": "assistant", "content": None, "tool_calls": bad}])
    with pytest.raises(openai.BadRequestError, match="only allowed on assistant"):
        prompt_tokens(MSG + [{"role": "user", "content": "x", "tool_calls": [call]}])
