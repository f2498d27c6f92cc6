"""Fixtures of the integration tests (the servers themselves: live_server.py).

* ``server``: the shared one (max_model_len 1024, room for long generations to abort).
* ``fuzz_server``: a short context (64) so fuzzed requests stay cheap.
* ``strict_server``: an API key and max_queued_requests=1 (401 and 429 paths).
* ``make_server(**engine_kw)``: a private one for tests that break their engine (stopped after).
* ``client`` / ``strict_client``: the official openai client on them (no retries).
* ``native_server``: a Qwen2.5-template model read with ``--tool-call-parser hermes`` (auto tool
  choice on) and ``--reasoning-parser qwen3``, shared by the chat front ends' parser tests.
* ``templated_model_dir(tmp_path_factory, template)``: a tiny checkpoint whose tokenizer has one of
  ``chat_templates/``; ``literal_regex(text)``: a regex forcing exactly ``text`` (an output in a
  model's own format, made deterministic by structured outputs).
"""
from __future__ import annotations

from pathlib import Path

import openai
import pytest
import transformers

from asyncengine.integrations.openai_server.chat_render import ChatConfig
from live_server import API_KEY, LiveServer, make_engine
from model_utils import make_tiny_checkpoint

TEMPLATES = Path(__file__).parent / "chat_templates"


@pytest.fixture(scope="session")
def server(tiny_llama_dir):
    s = LiveServer(make_engine(tiny_llama_dir)).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def fuzz_server(tiny_llama_dir):
    s = LiveServer(make_engine(tiny_llama_dir, max_model_len=64, num_kv_blocks=128)).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def strict_server(tiny_llama_dir):
    s = LiveServer(make_engine(tiny_llama_dir, max_queued_requests=1), api_key=API_KEY).start()
    yield s
    s.stop()


@pytest.fixture
def make_server(tiny_llama_dir):
    made: list[LiveServer] = []

    def make(**engine_kw) -> LiveServer:
        s = LiveServer(make_engine(tiny_llama_dir, **engine_kw), own_engine=True).start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def templated_model_dir(tmp_path_factory, template: str) -> tuple[str, transformers.PreTrainedTokenizerBase]:
    """(the checkpoint's folder, its tokenizer) with ``chat_templates/<template>``."""
    d = tmp_path_factory.mktemp(f"templated-{template.split('.')[0]}")
    # room for a real template's tool prompt in the tiny byte-level tokenizer's many tokens
    make_tiny_checkpoint(str(d), "llama", tokenizer=True, max_position_embeddings=4096)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    tok.chat_template = (TEMPLATES / template).read_text()
    tok.save_pretrained(d)
    return str(d), tok


def literal_regex(text: str) -> str:
    return "".join("\\n" if ch == "\n" else ("\\" + ch if ch in "\\.^$*+?{}[]|()/" else ch) for ch in text)


@pytest.fixture(scope="session")
def native_server(tmp_path_factory):
    d, _ = templated_model_dir(tmp_path_factory, "qwen2.5.jinja")
    s = LiveServer(make_engine(d, max_model_len=2048), own_engine=True, chat_config=ChatConfig(
        tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")).start()
    yield s
    s.stop()


def openai_client(server: LiveServer, api_key: str = "unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0, timeout=60.0, **kw)


@pytest.fixture(scope="session")
def client(server):
    with openai_client(server) as c:
        yield c


@pytest.fixture(scope="session")
def strict_client(strict_server):
    with openai_client(strict_server, API_KEY) as c:
        yield c
