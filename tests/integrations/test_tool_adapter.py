"""The tool seam of the Responses and Messages endpoints: a model's text, fed in pieces, becomes
text deltas and calls; what may be a call is held until the end, plain text streams at once, and a
named tool's arguments stream as fragments that join into its arguments."""
from __future__ import annotations

import json

import pytest

from asyncengine.integrations.openai_server.errors import APIError
from asyncengine.integrations.openai_server.tool_adapter import (CallArgs, CallBegin, CallEnd, TextDelta,
                                                                  ToolSession)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def run(session: ToolSession, pieces: list[str]) -> list[list]:
    p = session.parser()
    return [p.feed(x) for x in pieces] + [p.finish()]


def test_plain_text_streams_at_once_under_auto():
    got = run(ToolSession(TOOLS, "auto", True), [" Hel", "lo", " there"])
    assert got == [[TextDelta(" Hel")], [TextDelta("lo")], [TextDelta(" there")], []]


def test_a_call_array_under_auto_is_held_and_parsed():
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    got = run(ToolSession(TOOLS, "auto", True), [" ", text[:10], text[10:]])
    assert got[:3] == [[], [], []]
    assert got[3] == [CallBegin(0, "get_weather"), CallArgs(0, '{"city": "Paris"}'), CallEnd(0, '{"city": "Paris"}'),
                      CallBegin(1, "get_time"), CallArgs(1, "{}"), CallEnd(1, "{}")]


def test_json_that_is_no_call_comes_out_as_text():
    got = run(ToolSession(TOOLS, "auto", True), ['{"a": ', "1}"])
    assert got == [[], [], [TextDelta('{"a": 1}')]]
    assert run(ToolSession(TOOLS, "auto", True), ['[{"name": "nope", "arguments": {}}]'])[-1] == [
        TextDelta('[{"name": "nope", "arguments": {}}]')]


def test_named_tool_streams_argument_fragments():
    s = ToolSession(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert s.structured() is not None
    got = run(s, ['{"city"', ': "Oslo"}'])
    assert got == [[CallBegin(0, "get_weather"), CallArgs(0, '{"city"')], [CallArgs(0, ': "Oslo"}')],
                   [CallEnd(0, '{"city": "Oslo"}')]]
    assert json.loads("".join(e.delta for evs in got for e in evs if isinstance(e, CallArgs))) == {"city": "Oslo"}


def test_required_is_held_whole_and_no_tools_is_all_text():
    s = ToolSession(TOOLS, "required", False)
    assert s.structured() is not None
    got = run(s, ['[{"name": "get_time", ', '"arguments": {}}]'])
    assert got[:2] == [[], []] and got[2][0] == CallBegin(0, "get_time")
    assert run(ToolSession(None, None, None), ["[1]"]) == [[TextDelta("[1]")], []]
    assert not ToolSession(TOOLS, "none", None).active


@pytest.mark.parametrize("tools, choice, param", [
    (None, "required", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([{"type": "function"}], "auto", "tools[0]"),
])
def test_bad_tools_are_400s_naming_the_field(tools, choice, param):
    with pytest.raises(APIError) as e:
        ToolSession(tools, choice, None)
    assert e.value.status == 400 and e.value.param == param


def test_builders_take_calls_ended_late():
    """A parser may end every call only at the end of the output (after the next one began): both
    APIs' builders still give each call its own arguments and well-formed events."""
    from asyncengine.integrations.openai_server.anthropic_messages import ContentBuilder
    from asyncengine.integrations.openai_server.responses_output import OutputBuilder

    evs = [TextDelta("hi"), CallBegin(0, "a"), CallArgs(0, '{"x": 1}'), CallBegin(1, "b"), CallArgs(1, "{}"),
           CallEnd(0, '{"x": 1}'), CallEnd(1, "{}")]
    cb = ContentBuilder()
    wire = [e for ev in evs for e in cb.on(ev)] + cb.stop()
    assert cb.blocks[0] == {"type": "text", "text": "hi"}
    assert [(b["name"], b["input"]) for b in cb.blocks[1:]] == [("a", {"x": 1}), ("b", {})]
    starts = [e["index"] for e in wire if e["type"] == "content_block_start"]
    stops = [e["index"] for e in wire if e["type"] == "content_block_stop"]
    assert starts == stops == [0, 1, 2]
    ob = OutputBuilder()
    wire = [e for ev in evs for e in ob.on(ev)] + ob.close()
    assert [i["type"] for i in ob.items] == ["message", "function_call", "function_call"]
    assert [(i["name"], i["arguments"], i["status"]) for i in ob.items[1:]] == [("a", '{"x": 1}', "completed"),
                                                                               ("b", "{}", "completed")]
    done = [e["output_index"] for e in wire if e["type"] == "response.output_item.done"]
    assert sorted(done) == [0, 1, 2]
