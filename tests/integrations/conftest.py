"""Fixtures of the integration tests (the servers themselves: live_server.py).

* ``server``: the shared one (max_model_len 1024, room for long generations to abort).
* ``fuzz_server``: a short context (64) so fuzzed requests stay cheap.
* ``strict_server``: an API key and max_queued_requests=1 (401 and 429 paths).
* ``make_server(**engine_kw)``: a private one for tests that break their engine (stopped after).
* ``client`` / ``strict_client``: the official openai client on them (no retries).
"""
from __future__ import annotations

import openai
import pytest

from live_server import API_KEY, LiveServer, make_engine


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
