"""The LlamaIndex LLM (integrations/llamaindex.py) over a shared tiny random-weight engine: the
four chat and four completion entry points, and an abandoned async stream aborting its request."""
from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.llms import ChatMessage  # noqa: E402

from asyncengine.integrations.engine_thread import EngineBridge, close_shared_engines, shared_engine  # noqa: E402
from asyncengine.integrations.llamaindex import AsyncEngineLLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
OPTIONS = {"dtype": "float32", "max_model_len": 1024}
MSGS = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="Hello")]

@pytest.fixture(autouse=True, scope="module")
def _close_engines():
    """The engines these tests built (shared per model) are shut down with the module."""
    yield
    close_shared_engines()



def _llm(model_dir, **kw) -> AsyncEngineLLM:
    return AsyncEngineLLM(model=model_dir, engine_options=OPTIONS, **kw)


def test_chat_and_complete_sync(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, max_tokens=6, temperature=0.0)
    assert llm.metadata.is_chat_model and llm.metadata.context_window == 1024
    r = llm.chat(MSGS)
    chunks = list(llm.stream_chat(MSGS))
    assert r.message.content == chunks[-1].message.content == "".join(c.delta for c in chunks)
    assert r.raw["completion_tokens"] == 6 or r.raw["finish_reason"] == "stop"
    c = llm.complete("The quick brown fox")
    parts = list(llm.stream_complete("The quick brown fox"))
    assert c.text == parts[-1].text == "".join(p.delta for p in parts)


async def test_chat_and_complete_async(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, max_tokens=6, temperature=0.0)
    r = await llm.achat(MSGS)
    chunks = [c async for c in await llm.astream_chat(MSGS)]
    assert r.message.content == chunks[-1].message.content == llm.chat(MSGS).message.content
    c = await llm.acomplete("The quick brown fox")
    assert c.text == "".join([p.delta async for p in await llm.astream_complete("The quick brown fox")])


async def test_abandoned_astream_aborts(tiny_llama_dir):
    async def stats(e):
        return e.stats()

    bridge = EngineBridge(shared_engine(tiny_llama_dir, OPTIONS))
    before = (await bridge.acall(stats))["total_output_tokens"]
    llm = _llm(tiny_llama_dir, max_tokens=600)
    gen = await llm.astream_chat(MSGS)
    await gen.__anext__()
    await gen.aclose()
    end = time.monotonic() + 30
    while (s := await bridge.acall(stats))["num_running"] and time.monotonic() < end:
        await asyncio.sleep(0.02)
    assert s["num_running"] == 0 and s["num_streams"] == 0 and s["num_free_kv_blocks"] == s["num_kv_blocks"]
    assert s["total_output_tokens"] - before < 600
