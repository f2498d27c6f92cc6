"""Tool-call formats and reasoning spans, whole and streamed. Expected values are written from each
format's spec (what vLLM's parser of that name answers for the same text: content before the calls
or None, arguments re-encoded with ``json.dumps``). Every streamed case is fed split at every
position (and one character at a time): the joined deltas must equal the whole message."""
from __future__ import annotations

import json

import pytest

from asyncengine.integrations.chat_parsers import OutputParser, parse_output, reasoning_format, tool_format

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
W_ARGS = json.dumps({"city": "Paris", "unit": "c"})
T = '{"name": "get_time", "arguments": {}}'

# (format, output text, expected content, expected [(name, arguments)])
TOOL_CASES = [
    ("hermes", "plain answer", "plain answer", []),
    ("hermes", f"<tool_call>\n{W}\n</tool_call>", None, [("get_weather", W_ARGS)]),
    ("hermes", f"Let me check.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>",
     "Let me check.\n", [("get_weather", W_ARGS), ("get_time", "{}")]),
    ("hermes", f"<tool_call>\n{W}", None, [("get_weather", W_ARGS)]),  # unclosed last block: still a call
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("hermes", 'use <tool_call>\n{"name": "f", "arguments": {"s": "a}b\\"c", "n": [1, {"x": null}]}}\n</tool_call>',
     "use ", [("f", json.dumps({"s": 'a}b"c', "n": [1, {"x": None}]}))]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"q": "héllo ✓"}}\n</tool_call>', None,
     [("f", '{"q": "héllo ✓"}')]),
    ("mistral", "no tools", "no tools", []),
    ("mistral", f"[TOOL_CALLS][{W}, {T}]", None, [("get_weather", W_ARGS), ("get_time", "{}")]),
    ("mistral", f"Sure. [TOOL_CALLS] [{W}]", "Sure. ", [("get_weather", W_ARGS)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]get_time[ARGS]{}',
     None, [("get_weather", W_ARGS), ("get_time", "{}")]),
    ("mistral", "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', None,
     [("get_weather", W_ARGS)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
                    '{"name": "get_time", "parameters": {}}', None, [("get_weather", W_ARGS), ("get_time", "{}")]),
    ("llama3_json", "The weather is nice.", "The weather is nice.", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("granite", f"<|tool_call|>[{W}, {T}]", None, [("get_weather", W_ARGS), ("get_time", "{}")]),
    ("granite", f"<tool_call>[{W}]", None, [("get_weather", W_ARGS)]),
    ("granite", "Hello there", "Hello there", []),
    ("pythonic", '[get_weather(city="Paris", unit="c"), get_time()]', None,
     [("get_weather", W_ARGS), ("get_time", "{}")]),
    ("pythonic", "[f(a=1, b=True, c=None, d=[1, 'x'], e={'k': 2.5})]", None,
     [("f", json.dumps({"a": 1, "b": True, "c": None, "d": [1, "x"], "e": {"k": 2.5}}))]),
    ("pythonic", "[1, 2]", "[1, 2]", []),
    ("pythonic", "It is sunny.", "It is sunny.", []),
    ("json_array", f"[{W}]", None, [("get_weather", W_ARGS)]),
    ("json_array", W, None, [("get_weather", W_ARGS)]),
    ("json_array", '[{"name": "unknown_tool", "arguments": {}}]', '[{"name": "unknown_tool", "arguments": {}}]', []),
    ("json_array", "[1, 2, 3]", "[1, 2, 3]", []),
]

TOOLS = {"get_weather", "get_time"}


def _fmt(name):
    return tool_format(name, TOOLS)


@pytest.mark.parametrize("fmt,text,content,calls", TOOL_CASES)
def test_whole(fmt, text, content, calls):
    msg = parse_output(text, _fmt(fmt))
    assert msg.content == content
    assert [(c.name, c.arguments) for c in msg.tool_calls] == calls
    assert msg.reasoning is None
    if fmt == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in msg.tool_calls)
    else:
        assert all(c.id.startswith("call_") for c in msg.tool_calls)


def _stream(parser: OutputParser, pieces: list[str]):
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls:
            if tc.name is not None:
                assert tc.index not in calls, "a call's name is sent once, first"
                assert tc.index == len(calls), "calls start in order"
                calls[tc.index] = {"id": tc.id, "name": tc.name, "arguments": ""}
            else:
                assert tc.index in calls, "arguments only after the call's name"
            calls[tc.index]["arguments"] += tc.arguments
    return reasoning, content, [calls[i] for i in sorted(calls)]


def _splits(text: str):
    yield list(text)
    for k in range(len(text) + 1):
        yield [text[:k], text[k:]]


@pytest.mark.parametrize("fmt,text,content,calls", TOOL_CASES)
def test_streamed_at_every_split(fmt, text, content, calls):
    for pieces in _splits(text):
        parser = OutputParser(_fmt(fmt))
        reasoning, got_content, got_calls = _stream(parser, pieces)
        assert reasoning == ""
        if calls:
            assert got_content == (content or "")
            assert [c["name"] for c in got_calls] == [n for n, _ in calls]
            assert [json.loads(c["arguments"]) for c in got_calls] == [json.loads(a) for _, a in calls]
            whole = parser.result()
            assert [c.id for c in whole.tool_calls] == [c["id"] for c in got_calls]
        else:
            assert got_content == content and got_calls == []


# (parser, chat_template_kwargs, output text, expected reasoning, expected content)
REASONING_CASES = [
    ("deepseek_r1", None, "I think so.</think>The answer is 4.", "I think so.", "The answer is 4."),
    ("deepseek_r1", None, "<think>\nhmm\n</think>\n\n4", "\nhmm\n", "\n\n4"),
    ("deepseek_r1", None, "still thinking, cut off", "still thinking, cut off", None),
    ("deepseek_r1", None, "a < b </thin k></think>ok", "a < b </thin k>", "ok"),
    ("qwen3", None, "<think>\nstep 1\n</think>\n\nDone.", "\nstep 1\n", "\n\nDone."),
    ("qwen3", None, "step</think>", "step", None),
    ("qwen3", {"enable_thinking": False}, "Just the answer.", None, "Just the answer."),
    ("qwen3", {"enable_thinking": True}, "no end yet", "no end yet", None),
]


@pytest.mark.parametrize("name,kw,text,reasoning,content", REASONING_CASES)
def test_reasoning_whole(name, kw, text, reasoning, content):
    msg = parse_output(text, reasoning=reasoning_format(name, kw))
    assert (msg.reasoning, msg.content) == (reasoning, content)


@pytest.mark.parametrize("name,kw,text,reasoning,content", REASONING_CASES)
def test_reasoning_streamed_at_every_split(name, kw, text, reasoning, content):
    for pieces in _splits(text):
        got = _stream(OutputParser(reasoning=reasoning_format(name, kw)), pieces)
        assert got == (reasoning or "", content or "", [])


def test_end_of_thinking_never_leaks_while_streaming():
    """'</think>' split across pieces: no piece of it reaches either side."""
    p = OutputParser(reasoning=reasoning_format("qwen3"))
    seen = [p.feed(x) for x in ("<think>ab</th", "in", "k>c")]
    assert [(d.reasoning, d.content) for d in seen] == [("ab", ""), ("", ""), ("", "c")]


def test_reasoning_then_calls():
    text = f"<think>weather?</think>\n\n<tool_call>\n{W}\n</tool_call>"
    msg = parse_output(text, _fmt("hermes"), reasoning_format("qwen3"))
    assert msg.reasoning == "weather?" and msg.content == "\n\n"
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", W_ARGS)]
    for pieces in _splits(text):
        r, c, calls = _stream(OutputParser(_fmt("hermes"), reasoning_format("qwen3")), pieces)
        assert (r, c, [x["name"] for x in calls]) == ("weather?", "\n\n", ["get_weather"])
        assert json.loads(calls[0]["arguments"]) == json.loads(W_ARGS)


def test_named_tool_answer_is_its_arguments():
    text = '{"city": "Paris", "unit": "c"}'
    msg = parse_output(text, named="get_weather")
    assert msg.content is None and [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", W_ARGS)]
    for pieces in _splits(text):
        _, content, calls = _stream(OutputParser(named="get_weather"), pieces)
        assert content == "" and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == text


def test_unknown_parser_names():
    with pytest.raises(ValueError, match="hermes"):
        tool_format("nope")
    with pytest.raises(ValueError, match="qwen3"):
        reasoning_format("nope")


def test_plain_text_passes_as_it_comes():
    p = OutputParser()
    assert [p.feed(x).content for x in ("<tool", "_call>", " [")] == ["<tool", "_call>", " ["]
    assert not p.finish() and p.result().content == "<tool_call> ["
