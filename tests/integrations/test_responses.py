"""The official ``openai`` client's Responses API against the live server: one turn equals the chat
completion of the same messages, the typed stream event by event, function tools forced by
tool_choice (so calls are deterministic), conversations continued by previous_response_id (the
second turn reports cached_tokens from the prefix cache), GET/DELETE, store: false, and hostile
input answered with clear 4xx."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from conftest import literal_regex, openai_client
from live_server import HANG_GUARD_S, MODEL

NO_EOS = {"ignore_eos": True}
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": CITY}
LONG_INPUT = "Tell me, in a few words, what the weather is like in Paris in the early days of spring."


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=HANG_GUARD_S)


def test_one_turn_is_the_chat_completion_of_the_same_messages(client):
    r = client.responses.create(model=MODEL, instructions="You are terse.", input="Name a fox.", temperature=0,
                                max_output_tokens=6, extra_body=NO_EOS)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "You are terse."},
                               {"role": "user", "content": "Name a fox."}],
        temperature=0, max_tokens=6, extra_body=NO_EOS)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert r.output_text == msg.content[0].text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    assert r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.instructions == "You are terse." and r.max_output_tokens == 6


def test_stream_is_the_typed_event_sequence(client):
    kw = dict(model=MODEL, input="Name a fox.", temperature=0, max_output_tokens=5, extra_body=NO_EOS)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    n_deltas = types.count("response.output_text.delta")
    assert n_deltas >= 1
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * n_deltas
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-4]
    assert done.text == text == whole.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2])
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == text and final.usage.output_tokens == 5
    assert client.responses.retrieve(final.id).output_text == text  # a streamed response is stored too


def test_stream_helper_gives_the_final_response(client):
    with client.responses.stream(model=MODEL, input="Name a fox.", max_output_tokens=4) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_tool_is_called(client, stream):
    kw = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    if not stream:
        r = client.responses.create(**kw)
    else:
        events = list(client.responses.create(stream=True, **kw))
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done.arguments == args and done.name == "get_weather"
        assert events[2].type == "response.output_item.added" and events[2].item.type == "function_call"
        r = events[-1].response
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo") and call.call_id.startswith("call_")


def test_required_tool_call_then_its_output_continues_the_conversation(client):
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=3,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete") and follow.previous_response_id == r.id
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_previous_response_id_continues_with_cached_tokens(client):
    first = client.responses.create(model=MODEL, input=LONG_INPUT, max_output_tokens=4, temperature=0)
    second = client.responses.create(model=MODEL, input="And in autumn?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    # the second prompt holds the first turn (its input and output) and the new input
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.previous_response_id == first.id
    # a stored response is what was answered; DELETE forgets it
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=2)


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model=MODEL, input="hello", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_text_format_json_schema_constrains_the_output(client):
    r = client.responses.create(model=MODEL, input="Pick a city.", max_output_tokens=30,
                                text={"format": {"type": "json_schema", "name": "city", "schema": CITY}})
    assert json.loads(r.output_text)["city"] in ("Paris", "Oslo")


def test_message_list_input_with_roles(client):
    items = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
             {"role": "user", "content": "Name a fox."}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=3, temperature=0, extra_body=NO_EOS)
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=3, extra_body=NO_EOS,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Name a fox."}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


# ---------------------------------------------------------------- the model's own format, reasoning

BUDGET = 5
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
ASK = "Weather in Paris?"
# what the grammar forces after the reasoning span: a call in Qwen's (hermes) format
FORCED_CALL = {"structured_outputs": {"regex": literal_regex(
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')}}


@pytest.fixture(scope="module")
def native(native_server):
    with openai_client(native_server) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_item_then_a_call_in_the_models_format(native, stream):
    """hermes + qwen3 (native_server): the reasoning span, closed by max_reasoning_tokens, is a
    reasoning item holding what chat's reasoning_content holds; the call after it, written in Qwen's
    <tool_call> format, is a function_call, as chat's parsers read it."""
    extra = {**FORCED_CALL, "max_reasoning_tokens": BUDGET}
    chat = native.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                          tools=[CHAT_WEATHER], temperature=0, max_tokens=300,
                                          extra_body=extra).choices[0].message
    kw = dict(model=MODEL, input=ASK, tools=[WEATHER], temperature=0, max_output_tokens=300, extra_body=extra)
    if stream:
        events = list(native.responses.create(stream=True, **kw))
        types = [e.type for e in events]
        n = types.count("response.reasoning_text.delta")
        assert n >= 1 and types[2:4 + n + 4] == (
            ["response.output_item.added", "response.content_part.added"] + ["response.reasoning_text.delta"] * n
            + ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
               "response.output_item.added"])
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert events[4 + n].text == thought and events[4 + n].item_id == events[2].item.id
        assert "response.function_call_arguments.done" in types and "response.output_text.delta" not in types
        r = events[-1].response
    else:
        r = native.responses.create(**kw)
    rs, call = r.output
    assert rs.type == "reasoning" and rs.status == "completed" and [c.type for c in rs.content] == ["reasoning_text"]
    assert rs.content[0].text == chat.reasoning_content and rs.content[0].text
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and r.status == "completed"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in chat.tool_calls] == [
        ("get_weather", {"city": "Paris"})]


def test_thinking_off_and_the_calls_output_through_the_template(native, native_server):
    """chat_template_kwargs enable_thinking false: all answer, no reasoning item; the call and its
    output come back in the next turn's prompt as chat renders the same conversation."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = native.responses.create(model=MODEL, input=ASK, tools=[WEATHER], temperature=0, max_output_tokens=300,
                                extra_body={**FORCED_CALL, **off})
    [call] = r.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    follow = native.responses.create(
        model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=2, extra_body=off,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": call.call_id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    rendered = post(native_server, "/tokenize", {"model": MODEL, "messages": messages, "tools": [CHAT_WEATHER],
                                                 "chat_template_kwargs": off["chat_template_kwargs"]}).json()
    assert follow.usage.input_tokens == rendered["count"] > r.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0


# ---------------------------------------------------------------- hostile input


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL}, 400, "input"),
    ({"model": MODEL, "input": 7}, 400, "input"),
    ({"model": MODEL, "input": [{"type": "image_generation_call"}]}, 400, "input[0].type"),
    ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input[0].content[0]"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ({"model": MODEL, "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     400, "tool_choice"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"model": MODEL, "input": "x", "temperature": 9}, 400, "temperature"),
    ({"model": MODEL, "input": "x", "background": True}, 400, "background"),
    ({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "schema": 3}}}, 400,
     "text.format.schema"),
    ({"model": MODEL, "input": "x", "text": {"format": {"type": "bogus"}}}, 400, "text.format.type"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400,
     "input[0].content[0].text"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"model": "other-model", "input": "x"}, 404, "model"),
    ({"model": MODEL, "input": "x", "max_reasoning_tokens": 3}, 400, "max_reasoning_tokens"),
])
def test_bad_requests_are_clear_4xx(server, body, status, param):
    r = post(server, "/v1/responses", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    server.wait_clean()


def test_oversize_input_and_unknown_ids(server):
    r = post(server, "/v1/responses", {"model": MODEL, "input": "fox " * 3000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    big = {"model": MODEL, "input": "x" * (server.engine.limits.max_request_bytes + 10)}
    r = post(server, "/v1/responses", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server.base_url + "/v1/responses/resp_nope").status_code == 404
    assert httpx.delete(server.base_url + "/v1/responses/resp_nope").status_code == 404
    server.wait_clean()
