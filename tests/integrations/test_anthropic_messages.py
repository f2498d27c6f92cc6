"""The official ``anthropic`` client against the live server: ``messages.create`` equals the chat
completion of the same conversation, stop_reason mapping (max_tokens, stop_sequence, tool_use),
``messages.stream`` event by event, tool use forced by tool_choice (deterministic calls), tool
results in the history, Anthropic's error shape, and ``x-api-key`` next to Bearer."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from conftest import literal_regex, openai_client
from live_server import API_KEY, HANG_GUARD_S, MODEL

NO_EOS = {"ignore_eos": True}
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": CITY}
HELLO = [{"role": "user", "content": "Name a fox."}]
GREEDY = {"temperature": 0}  # the client (2.x) no longer has sampling arguments; the API still takes them


def client_for(server, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=server.base_url, max_retries=0, timeout=HANG_GUARD_S, **kw)


@pytest.fixture(scope="module")
def ac(server):
    with client_for(server) as c:
        yield c


def test_create_is_the_chat_completion_of_the_same_conversation(ac, client):
    m = ac.messages.create(model=MODEL, max_tokens=6, system="You are terse.", messages=HELLO, extra_body=GREEDY)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "You are terse."}, *HELLO])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    expected = "max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn"
    assert m.stop_reason == expected and m.stop_sequence is None


def test_stop_sequences_end_with_stop_sequence(ac, client):
    kw = dict(model=MODEL, temperature=0, extra_body=NO_EOS)
    text = client.chat.completions.create(messages=HELLO, max_tokens=8, **kw).choices[0].message.content
    stop = text[2:4]
    assert stop.strip() and text.index(stop) == 2, repr(text)
    m = ac.messages.create(model=MODEL, max_tokens=8, messages=HELLO, extra_body=GREEDY, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:2]


def test_stream_events_and_final_message(ac):
    kw = dict(model=MODEL, max_tokens=5, messages=HELLO, extra_body=GREEDY)
    whole = ac.messages.create(**kw)
    with ac.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events if e.type != "text"]  # "text": the helper's own per-delta event
    n = types.count("content_block_delta")
    assert n >= 1
    assert types == ["message_start", "content_block_start", *["content_block_delta"] * n, "content_block_stop",
                     "message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text == "".join(
        e.delta.text for e in events if e.type == "content_block_delta")
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_raw_stream_has_ping_and_named_events(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": HELLO, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/messages", json=body, timeout=HANG_GUARD_S) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("event: ")]
    assert lines[:2] == ["event: message_start", "event: ping"] and lines[-1] == "event: message_stop"


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use(ac, stream):
    kw = dict(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        with ac.messages.stream(**kw) as s:
            events = list(s)
            m = s.get_final_message()
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert deltas and all(d.type == "input_json_delta" for d in deltas)
        start = next(e for e in events if e.type == "content_block_start")
        assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    else:
        m = ac.messages.create(**kw)
    [block] = m.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert block.input["city"] in ("Paris", "Oslo") and set(block.input) == {"city"}
    assert m.stop_reason == "tool_use"


def test_any_tool_then_tool_result(ac):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    m = ac.messages.create(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER], tool_choice={"type": "any"})
    [use] = m.content
    assert use.type == "tool_use" and m.stop_reason == "tool_use"
    history = ask + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                         "input": use.input}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "sunny, 21 C"}]}]
    m2 = ac.messages.create(model=MODEL, max_tokens=3, messages=history, tools=[WEATHER])
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens > \
        m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_count_tokens_is_the_prompt_length(ac):
    kw = dict(model=MODEL, system="You are terse.", messages=HELLO, tools=[WEATHER])
    counted = ac.messages.count_tokens(**kw).input_tokens
    m = ac.messages.create(max_tokens=1, **kw)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert ac.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens < counted


def test_output_config_json_schema_constrains_the_text(ac):
    m = ac.messages.create(model=MODEL, max_tokens=30, messages=[{"role": "user", "content": "Pick a city."}],
                           output_config={"format": {"type": "json_schema", "schema": CITY}})
    assert json.loads(m.content[0].text)["city"] in ("Paris", "Oslo")


# ---------------------------------------------------------------- the model's own format, thinking

BUDGET = 5
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                 "parameters": CITY}}
# what the grammar forces after the reasoning span: a call in Qwen's (hermes) format
FORCED_CALL = {"structured_outputs": {"regex": literal_regex(
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')}}


@pytest.fixture(scope="module")
def native_ac(native_server):
    with client_for(native_server) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_then_tool_use_in_the_models_format(native_ac, native_server, stream):
    """hermes + qwen3 (native_server): thinking.budget_tokens closes the reasoning span, which comes
    as a thinking block holding what chat's reasoning_content holds; the call after it, written in
    Qwen's <tool_call> format, is a tool_use block, as chat's parsers read it."""
    with openai_client(native_server) as oc:
        chat = oc.chat.completions.create(model=MODEL, messages=ASK, tools=[CHAT_WEATHER], temperature=0,
                                          max_tokens=300, extra_body={**FORCED_CALL, "max_reasoning_tokens": BUDGET})
    thought = chat.choices[0].message.reasoning_content
    kw = dict(model=MODEL, max_tokens=300, messages=ASK, tools=[WEATHER], extra_body={**GREEDY, **FORCED_CALL},
              thinking={"type": "enabled", "budget_tokens": BUDGET})
    if stream:
        with native_ac.messages.stream(**kw) as s:
            events = list(s)
            m = s.get_final_message()
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["thinking", "tool_use"]
        assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thought
        assert {d.type for d in deltas} == {"thinking_delta", "input_json_delta"}
    else:
        m = native_ac.messages.create(**kw)
    think, use = m.content
    assert think.type == "thinking" and think.thinking == thought and thought
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert m.stop_reason == "tool_use"


def test_thinking_disabled_is_all_answer(native_ac, ac):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], thinking={"type": "disabled"})
    m = native_ac.messages.create(max_tokens=300, extra_body={**GREEDY, **FORCED_CALL}, **kw)
    [use] = m.content
    assert use.type == "tool_use" and use.input == {"city": "Paris"} and m.stop_reason == "tool_use"
    assert native_ac.messages.count_tokens(**kw).input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError, match="thinking.type"):
        native_ac.messages.create(max_tokens=2, **{**kw, "thinking": {"type": "bogus"}})
    # a server without --reasoning-parser reads no reasoning: the field changes nothing there
    plain = ac.messages.create(model=MODEL, max_tokens=2, messages=HELLO, thinking={"type": "enabled",
                                                                                   "budget_tokens": 1024})
    assert plain.type == "message" and {b.type for b in plain.content} <= {"text"}


# ---------------------------------------------------------------- errors and keys


@pytest.mark.parametrize("body, status, kind", [
    ({"model": MODEL, "messages": HELLO}, 400, "invalid_request_error"),  # no max_tokens
    ({"model": MODEL, "max_tokens": 4, "messages": []}, 400, "invalid_request_error"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, 400,
     "invalid_request_error"),
    ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "temperature": 1.5}, 400, "invalid_request_error"),
    ({"model": MODEL, "max_tokens": 4, "messages": [*HELLO, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": "Paris"}]}]}, 400, "invalid_request_error"),
    ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "tools": [{"type": "web_search_20250305",
                                                                     "name": "web_search"}]}, 400,
     "invalid_request_error"),
    ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "fox " * 3000}]}, 400,
     "invalid_request_error"),
    ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "output_config": {"format": {"type": "regex"}}}, 400,
     "invalid_request_error"),
    ({"model": "other-model", "max_tokens": 4, "messages": HELLO}, 404, "not_found_error"),
])
def test_errors_have_anthropics_shape(server, body, status, kind):
    r = httpx.post(server.base_url + "/v1/messages", json=body, timeout=HANG_GUARD_S)
    assert r.status_code == status, r.text
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == kind and got["error"]["message"], got
    assert "Traceback" not in r.text
    server.wait_clean()


def test_client_errors_are_its_exception_types(ac, server):
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.create(model="other-model", max_tokens=2, messages=HELLO)
    big = "x" * (server.engine.limits.max_request_bytes + 10)
    with pytest.raises(anthropic.APIStatusError) as e:
        ac.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": big}])
    assert e.value.status_code == 413 and e.value.body["error"]["type"] == "request_too_large"


def test_x_api_key_and_bearer(strict_server):
    with client_for(strict_server, api_key=API_KEY) as c:  # sends x-api-key
        assert c.messages.create(model=MODEL, max_tokens=2, messages=HELLO).type == "message"
    with client_for(strict_server, api_key=None, auth_token=API_KEY) as c:  # sends Authorization: Bearer
        assert c.messages.create(model=MODEL, max_tokens=2, messages=HELLO).type == "message"
    with client_for(strict_server, api_key="wrong") as c, pytest.raises(anthropic.AuthenticationError) as e:
        c.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert e.value.body["error"]["type"] == "authentication_error"
