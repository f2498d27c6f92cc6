"""Tool calls in each model's own format through the official openai client, on tiny models whose
chat templates are Qwen2.5's (hermes), Llama 3.1's (llama3_json) and Mistral's (mistral): the
tools reach the template, and an output forced by a regex to be the format's call text comes back
as the calls that format's spec gives (vLLM's parsers answer the same), whole and streamed (name
first, argument pieces that join into the JSON); ``required`` and a named tool stream too."""
from __future__ import annotations

import json

import jsonschema
import pytest

from asyncengine.integrations.openai_server.chat_render import ChatConfig
from conftest import literal_regex, openai_client, templated_model_dir
from live_server import MODEL, LiveServer, make_engine

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = {"city": "Paris", "unit": "c"}

# template, parser, the output forced, the calls its format's spec gives [(name, arguments)], content
FORMATS = {
    "hermes": ("qwen2.5.jinja",
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
               [("get_weather", PARIS), ("get_time", {"tz": "UTC"})], None),
    "llama3_json": ("llama3.1_json.jinja", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
                    [("get_weather", PARIS)], None),
    "mistral": ("mistral_v0.3.jinja", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                                      '"unit": "c"}}]', [("get_weather", PARIS)], "Sure."),
}


@pytest.fixture(scope="module", params=list(FORMATS))
def tool_server(request, tmp_path_factory):
    parser = request.param
    d, tok = templated_model_dir(tmp_path_factory, FORMATS[parser][0])
    s = LiveServer(make_engine(d, max_model_len=2048), own_engine=True,
                   chat_config=ChatConfig(tool_call_parser=parser, enable_auto_tool_choice=True)).start()
    with openai_client(s) as client:
        yield parser, tok, client
    s.stop()


def _chat(client, stream: bool, **kw):
    kw.setdefault("max_tokens", 400)
    kw.setdefault("temperature", 0.0)
    if not stream:
        c = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, **kw).choices[0]
        calls = [(tc.id, tc.function.name, tc.function.arguments) for tc in c.message.tool_calls or []]
        return c.message.content, calls, c.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.function.name is not None:  # a call's first piece: its id and whole name
                    assert tc.index not in calls and tc.id
                    calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
                else:
                    calls[tc.index][2] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def test_tools_reach_the_template(tool_server):
    parser, tok, client = tool_server
    r = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=1)
    ref = tok.apply_chat_template(MSG, tools=TOOLS, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(ref["input_ids"] if hasattr(ref, "keys") else ref)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_in_the_model_format(tool_server, stream):
    parser, _, client = tool_server
    _, text, want, want_content = FORMATS[parser]
    content, calls, finish = _chat(client, stream, tool_choice="auto",
                                   extra_body={"structured_outputs": {"regex": literal_regex(text)}})
    assert finish == "tool_calls"
    assert content == want_content
    assert [(n, json.loads(a)) for _, n, a in calls] == want
    if not stream:  # a whole message carries the arguments re-encoded, as vLLM's parsers do
        assert [a for _, _, a in calls] == [json.dumps(args, ensure_ascii=False) for _, args in want]
    if parser == "mistral":
        assert all(len(i) == 9 and i.isalnum() for i, _, _ in calls)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_stream_as_they_answer(tool_server, choice):
    _, _, client = tool_server
    whole = _chat(client, False, tool_choice=choice, parallel_tool_calls=False)
    streamed = _chat(client, True, tool_choice=choice, parallel_tool_calls=False)
    for content, calls, finish in (whole, streamed):
        assert finish == "tool_calls" and content is None and len(calls) == 1
        name, args = calls[0][1], json.loads(calls[0][2])
        assert name in ("get_weather", "get_time") if choice == "required" else name == "get_time"
        jsonschema.validate(args, WEATHER if name == "get_weather" else TIME)
    assert [(n, json.loads(a)) for _, n, a in whole[1]] == [(n, json.loads(a)) for _, n, a in streamed[1]]


def test_auto_needs_the_flag(tiny_llama_dir):
    s = LiveServer(make_engine(tiny_llama_dir), own_engine=True,
                   chat_config=ChatConfig(tool_call_parser="hermes")).start()
    try:
        with openai_client(s) as client:
            import openai

            with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
                client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=1)
    finally:
        s.stop()
