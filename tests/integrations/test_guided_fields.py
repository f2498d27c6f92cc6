"""vLLM's structured-output fields through the official openai client's ``extra_body``:
``structured_outputs`` and the older ``guided_*`` give the same constrained output as
``response_format`` (greedy), on chat and completions; ``response_format`` works on the websocket
chat; an option we do not implement, or two constraints at once, is a 400 naming the field."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
import websockets

import xgrammar  # noqa: E402,F401  (a main dependency: missing fails the run, never skips it)

from live_server import MODEL  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 50}},
          "required": ["city", "n"], "additionalProperties": False}
MSG = [{"role": "user", "content": "Where?"}]


def chat(client, **kw):
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(model=MODEL, messages=MSG, temperature=0.0, **kw)


def test_json_fields_match_response_format(client):
    ref = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
    want = ref.choices[0].message.content
    assert ref.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(want), SCHEMA)
    for extra in ({"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)},
                  {"structured_outputs": {"json": SCHEMA}}):
        got = chat(client, extra_body=extra).choices[0].message.content
        assert got == want, extra
    obj = chat(client, response_format={"type": "json_object"}, max_tokens=80).choices[0]
    for extra in ({"guided_json_object": True}, {"structured_outputs": {"json_object": True}}):
        assert chat(client, max_tokens=80, extra_body=extra).choices[0].message.content == obj.message.content


def test_regex_choice_grammar_on_chat_and_completions(client):
    for extra in ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}):
        c = chat(client, extra_body=extra).choices[0]
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", c.message.content), c.message.content
    for extra in ({"guided_choice": ["red", "green", "blue"]}, {"structured_outputs": {"choice": ["red", "green", "blue"]}}):
        assert chat(client, extra_body=extra).choices[0].message.content in ("red", "green", "blue")
        r = client.completions.create(model=MODEL, prompt="Color:", max_tokens=10, temperature=0.0, extra_body=extra)
        assert r.choices[0].text in ("red", "green", "blue")
    g = 'root ::= "(" [0-9] [0-9]? ")"'
    for extra in ({"guided_grammar": g}, {"structured_outputs": {"grammar": g}}):
        assert re.fullmatch(r"\([0-9][0-9]?\)", chat(client, extra_body=extra).choices[0].message.content)
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=60, temperature=0.0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "s", "schema": SCHEMA}}})
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


@pytest.mark.parametrize("extra,param", [
    ({"structural_tag": {"type": "structural_tag"}}, "structural_tag"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"structured_outputs": {"json": SCHEMA, "structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_json"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_unsupported_or_conflicting_fields_are_400_naming_them(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_response_format_and_a_guided_field_together_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})
    assert e.value.body["param"] == "guided_regex"


def test_websocket_chat_honours_response_format(server):
    async def main():
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "chat", "id": 1, "messages": MSG, "temperature": 0.0, "max_tokens": 60,
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "s", "schema": SCHEMA}}}))
            text = ""
            while True:
                f = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if f["type"] == "delta":
                    text += f["text"]
                elif f["type"] == "done":
                    break
                else:
                    raise AssertionError(f)
            if f["finish_reason"] == "stop":
                jsonschema.validate(json.loads(text), SCHEMA)
            assert text.startswith("{")
            await ws.send(json.dumps({"type": "chat", "id": 2, "messages": MSG,
                                      "guided_regex": "[0-9]{1,99999}"}))
            f = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert f["type"] == "error" and f["id"] == 2 and "max_regex_repetition" in f["error"]["message"], f
            await ws.send(json.dumps({"type": "chat", "id": 3, "messages": MSG, "structural_tag": {}}))
            f = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert f["type"] == "error" and f["error"]["param"] == "structural_tag", f

    asyncio.run(main())


def test_grammar_metrics(server, client):
    chat(client, extra_body={"guided_choice": ["x", "y"]})
    with pytest.raises(openai.BadRequestError):
        chat(client, extra_body={"guided_regex": "a{1,99999}"})
    text = httpx.get(server.base_url + "/metrics").text
    cache = re.search(r"^asyncengine_grammar_cache_bytes (\S+)$", text, re.M)
    assert cache and float(cache.group(1)) > 0, text[-2000:]
    refused = re.search(r'^asyncengine_grammar_compiles_total\{outcome="refused"\} (\S+)$', text, re.M)
    assert refused and float(refused.group(1)) >= 1
