"""--reasoning-parser through the openai client: the reasoning span comes apart in
``reasoning_content`` (whole and streamed: the tiny tokenizer writes ``</think>`` in several tokens,
so the marker falls across chunks and must never leak), the grammar applies only after the span
(``max_reasoning_tokens`` closes it, so the output is deterministic), and ``chat_template_kwargs``
``enable_thinking: false`` reads the output as all answer."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest
import transformers
import websockets

from asyncengine.integrations.openai_server.chat_render import ChatConfig
from conftest import openai_client
from live_server import HANG_GUARD_S, MODEL, LiveServer, make_engine

MSG = [{"role": "user", "content": "Is Paris in France?"}]
ANSWER = {"structured_outputs": {"regex": "(yes|no)!"}}
BUDGET = 5


@pytest.fixture(scope="module")
def reasoning_server(tiny_llama_dir):
    s = LiveServer(make_engine(tiny_llama_dir), own_engine=True,
                   chat_config=ChatConfig(reasoning_parser="qwen3")).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reasoning(reasoning_server, tiny_llama_dir):
    with openai_client(reasoning_server) as client:
        yield client, transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)


def _ask(client, stream: bool, **extra):
    kw = dict(model=MODEL, messages=MSG, temperature=0.0, max_tokens=40, extra_body={**ANSWER, **extra})
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        return getattr(m, "reasoning_content", None), m.content, r.choices[0].finish_reason, r.usage.completion_tokens
    reasoning, content, finish, pieces = "", "", None, []
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for ch in chunk.choices:
            d = ch.delta.model_dump()
            reasoning += d.get("reasoning_content") or ""
            content += d.get("content") or ""
            pieces += [d.get("reasoning_content") or "", d.get("content") or ""]
            finish = ch.finish_reason or finish
    assert not any(m in p for p in pieces for m in ("</", "think>")), pieces  # no piece of the marker leaks
    return reasoning or None, content or None, finish, tokens


def test_reasoning_apart_then_the_grammar(reasoning):
    client, tok = reasoning
    end = len(tok.encode("</think>", add_special_tokens=False))
    whole = _ask(client, False, max_reasoning_tokens=BUDGET)
    streamed = _ask(client, True, max_reasoning_tokens=BUDGET)
    assert whole == streamed
    thought, answer, finish, tokens = whole
    assert answer in ("yes!", "no!") and finish == "stop"
    assert thought and "</think>" not in thought
    # the free span, the forced end marker, the answer, and the end-of-sequence token after the grammar
    assert tokens == BUDGET + end + len(tok.encode(answer, add_special_tokens=False)) + 1


def test_thinking_off_is_all_answer(reasoning):
    client, _ = reasoning
    for stream in (False, True):
        thought, answer, finish, _ = _ask(client, stream, chat_template_kwargs={"enable_thinking": False})
        assert thought is None and answer in ("yes!", "no!") and finish == "stop"


def test_budget_needs_the_parser(client):
    with pytest.raises(openai.BadRequestError, match="reasoning-parser"):
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2,
                                       extra_body={"max_reasoning_tokens": 3})


async def test_websocket_sends_reasoning_frames_apart(reasoning, reasoning_server):
    client, _ = reasoning
    thought, answer, _, _ = _ask(client, False, max_reasoning_tokens=BUDGET)
    frames = []
    async with websockets.connect(reasoning_server.ws_url) as ws:
        await ws.send(json.dumps({"type": "chat", "id": 1, "messages": MSG, "temperature": 0.0, "max_tokens": 40,
                                  "max_reasoning_tokens": BUDGET, **ANSWER}))
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(json.loads(await asyncio.wait_for(ws.recv(), HANG_GUARD_S)))
    assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "stop"
    assert "".join(f["text"] for f in frames if f["type"] == "reasoning") == thought
    assert "".join(f["text"] for f in frames if f["type"] == "delta") == answer
