"""--reasoning-parser through the openai client: the reasoning span comes apart in
``reasoning_content`` (whole and streamed: the tiny tokenizer writes ``</think>`` in several tokens,
so the marker falls across chunks and must never leak), the grammar applies only after the span
(``max_reasoning_tokens`` closes it, so the output is deterministic), and ``chat_template_kwargs``
``enable_thinking: false`` reads the output as all answer."""
from __future__ import annotations

import openai
import pytest
import transformers

from asyncengine.integrations.openai_server.chat_render import ChatConfig
from conftest import openai_client
from live_server import MODEL, LiveServer, make_engine

MSG = [{"role": "user", "content": "Is Paris in France?"}]
ANSWER = {"structured_outputs": {"regex": "(yes|no)!"}}
BUDGET = 5


@pytest.fixture(scope="module")
def reasoning(tiny_llama_dir):
    s = LiveServer(make_engine(tiny_llama_dir), own_engine=True,
                   chat_config=ChatConfig(reasoning_parser="qwen3")).start()
    with openai_client(s) as client:
        yield client, transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    s.stop()


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
