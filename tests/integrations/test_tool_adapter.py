"""The tool seam of the Responses and Messages endpoints is chat's parsers: a model's text, fed in
pieces, becomes reasoning, text and calls (a name first, argument pieces that join into its
arguments, one end per call) in the JSON-array fallback and in a model's own format, by the
server's ChatConfig as for /v1/chat/completions."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from asyncengine.integrations.openai_server.chat_render import ChatConfig
from asyncengine.integrations.openai_server.errors import APIError
from asyncengine.integrations.openai_server.tool_adapter import (CallArgs, CallBegin, CallEnd, ReasoningDelta,
                                                                  TextDelta, ToolSession)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
FALLBACK = SimpleNamespace(chat_config=ChatConfig())  # what ToolSession reads of the server state
HERMES = SimpleNamespace(chat_config=ChatConfig(tool_call_parser="hermes", enable_auto_tool_choice=True,
                                                reasoning_parser="qwen3"))


def session(tools, choice, parallel, st=FALLBACK, **kw) -> ToolSession:
    return ToolSession(st, tools, choice, parallel, **kw)


def run(s: ToolSession, pieces: list[str]) -> list[list]:
    p = s.parser()
    return [p.feed(x) for x in pieces] + [p.finish()]


def calls_of(events: list[list]) -> list[tuple[str, str, str]]:
    """(name, the joined argument pieces, the end's arguments) per call, checking the order."""
    flat = [e for evs in events for e in evs]
    begins = [e for e in flat if isinstance(e, CallBegin)]
    assert [b.index for b in begins] == list(range(len(begins))) and all(b.id for b in begins)
    ends = {e.index: e.arguments for e in flat if isinstance(e, CallEnd)}
    assert all(flat.index(b) < flat.index(e) for b in begins for e in flat
               if isinstance(e, (CallArgs, CallEnd)) and e.index == b.index)
    return [(b.name, "".join(e.delta for e in flat if isinstance(e, CallArgs) and e.index == b.index),
             ends[b.index]) for b in begins]


def test_plain_text_streams_at_once_under_auto():
    got = run(session(TOOLS, "auto", True), [" Hel", "lo", " there"])
    assert got == [[TextDelta(" Hel")], [TextDelta("lo")], [TextDelta(" there")], []]


def test_a_call_array_under_auto_streams_each_call():
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    got = run(session(TOOLS, "auto", True), [" ", text[:10], text[10:40], text[40:]])
    assert not any(isinstance(e, TextDelta) for evs in got for e in evs)
    assert [(n, json.loads(a), json.loads(end)) for n, a, end in calls_of(got)] == [
        ("get_weather", {"city": "Paris"}, {"city": "Paris"}), ("get_time", {}, {})]


def test_json_that_is_no_call_comes_out_as_text():
    got = run(session(TOOLS, "auto", True), ['{"a": ', "1}"])
    assert got == [[], [], [TextDelta('{"a": 1}')]]
    assert run(session(TOOLS, "auto", True), ['[{"name": "nope", "arguments": {}}]'])[-1] == [
        TextDelta('[{"name": "nope", "arguments": {}}]')]


def test_named_tool_streams_argument_fragments():
    s = session(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert s.structured() is not None
    got = run(s, ['{"city"', ': "Oslo"}'])
    assert isinstance(got[0][0], CallBegin) and got[0][0].name == "get_weather"
    assert got[0][1:] == [CallArgs(0, '{"city"')] and got[1] == [CallArgs(0, ': "Oslo"}')]
    assert got[2] == [CallEnd(0, '{"city": "Oslo"}')]


def test_required_parses_the_array_and_no_tools_is_all_text():
    s = session(TOOLS, "required", False)
    assert s.structured() is not None
    got = run(s, ['[{"name": "get_time", ', '"arguments": {}}]'])
    assert [(n, e) for n, _, e in calls_of(got)] == [("get_time", "{}")]
    assert run(session(None, None, None), ["[1]"]) == [[TextDelta("[1]")], []]
    assert not session(TOOLS, "none", None).active


def test_a_native_format_with_reasoning():
    """hermes + qwen3: the reasoning apart (the end marker across pieces), the text before the
    call, the call from the model's own <tool_call> format."""
    got = run(session(TOOLS, "auto", True, HERMES), [
        "<think>hm</th", 'ink>Sure.<tool_call>\n{"name": "get_time", "argu', 'ments": {"tz": "UTC"}}\n</tool_call>'])
    flat = [e for evs in got for e in evs]
    assert "".join(e.text for e in flat if isinstance(e, ReasoningDelta)) == "hm"
    assert "".join(e.text for e in flat if isinstance(e, TextDelta)) == "Sure."
    assert [(n, json.loads(a), json.loads(e)) for n, a, e in calls_of(got)] == [
        ("get_time", {"tz": "UTC"}, {"tz": "UTC"})]
    off = run(session(None, None, None, HERMES, chat_template_kwargs={"enable_thinking": False}), ["a</think>b"])
    assert [e for evs in off for e in evs] == [TextDelta("a</think>b")]


def test_auto_on_a_native_parser_needs_enable_auto_tool_choice():
    st = SimpleNamespace(chat_config=ChatConfig(tool_call_parser="hermes"))
    with pytest.raises(APIError) as e:
        session(TOOLS, "auto", None, st).check_generation()
    assert e.value.status == 400 and e.value.param == "tool_choice"
    session(TOOLS, "required", None, st).check_generation()


@pytest.mark.parametrize("tools, choice, param", [
    (None, "required", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([{"type": "function"}], "auto", "tools[0]"),
])
def test_bad_tools_are_400s_naming_the_field(tools, choice, param):
    with pytest.raises(APIError) as e:
        session(tools, choice, None)
    assert e.value.status == 400 and e.value.param == param


def test_a_budget_needs_the_reasoning_parser():
    with pytest.raises(APIError) as e:
        session(None, None, None, max_reasoning_tokens=3)
    assert e.value.param == "max_reasoning_tokens"


def test_builders_take_reasoning_and_calls_ended_late():
    """Reasoning comes first (a thinking block; a reasoning item), and a parser ends every call only
    at the end of the output (after the next one began): both APIs' builders still give each call
    its own arguments and well-formed events."""
    from asyncengine.integrations.openai_server.anthropic_messages import ContentBuilder
    from asyncengine.integrations.openai_server.responses_output import OutputBuilder

    evs = [ReasoningDelta("h"), ReasoningDelta("m"), TextDelta("hi"), CallBegin(0, "a", "call_a"),
           CallArgs(0, '{"x": 1}'), CallBegin(1, "b"), CallArgs(1, "{}"), CallEnd(0, '{"x": 1}'), CallEnd(1, "{}")]
    cb = ContentBuilder()
    wire = [e for ev in evs for e in cb.on(ev)] + cb.stop()
    assert cb.blocks[:2] == [{"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "hi"}]
    assert [(b["name"], b["input"]) for b in cb.blocks[2:]] == [("a", {"x": 1}), ("b", {})]
    assert [e["delta"] for e in wire if e["type"] == "content_block_delta"][:2] == [
        {"type": "thinking_delta", "thinking": "h"}, {"type": "thinking_delta", "thinking": "m"}]
    starts = [e["index"] for e in wire if e["type"] == "content_block_start"]
    stops = [e["index"] for e in wire if e["type"] == "content_block_stop"]
    assert starts == stops == [0, 1, 2, 3]
    ob = OutputBuilder()
    wire = [e for ev in evs for e in ob.on(ev)] + ob.close()
    assert [i["type"] for i in ob.items] == ["reasoning", "message", "function_call", "function_call"]
    assert ob.items[0]["content"] == [{"type": "reasoning_text", "text": "hm"}]
    assert [(i["name"], i["arguments"], i["status"]) for i in ob.items[2:]] == [("a", '{"x": 1}', "completed"),
                                                                               ("b", "{}", "completed")]
    assert ob.items[2]["call_id"] == "call_a" and ob.items[3]["call_id"].startswith("call_")
    assert [e["type"] for e in wire[:5]] == ["response.output_item.added", "response.content_part.added",
                                            "response.reasoning_text.delta", "response.reasoning_text.delta",
                                            "response.reasoning_text.done"]
    assert wire[4]["text"] == "hm"
    done = [e["output_index"] for e in wire if e["type"] == "response.output_item.done"]
    assert sorted(done) == [0, 1, 2, 3]
