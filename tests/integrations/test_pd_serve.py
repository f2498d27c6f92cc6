"""The OpenAI server over a PDEngine (one prefill and one decode core, each a process) against the
same server over one colocated engine: the openai client gets the same greedy tokens, streamed and
not; a client that leaves mid-stream (during the prefill or the decode) leaves every core's KV pool
whole and no transfer file; /health and /metrics read the P/D engine; the warm-up runs through it."""
from __future__ import annotations

import random
import time

import httpx
import openai
import pytest

from asyncengine import EngineConfig
from asyncengine.engine.async_engine import AsyncLLMEngine
from asyncengine.engine.warmup import warm_up
from live_server import HANG_GUARD_S, MODEL, LiveServer, make_engine

ENGINE_KW = dict(num_kv_blocks=64, block_size=8, max_model_len=256)


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tmp_path_factory):
    colo = LiveServer(make_engine(tiny_llama_dir, **ENGINE_KW), own_engine=True).start()
    pd = AsyncLLMEngine.from_config(EngineConfig(model=tiny_llama_dir, dtype="float32", prefill_cores=1, decode_cores=1,
                               kv_transfer_dir=str(tmp_path_factory.mktemp("pd")), **ENGINE_KW))
    pds = LiveServer(pd, own_engine=True).start()
    yield colo, pds
    pds.stop()
    colo.stop()


def client(s: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0, timeout=HANG_GUARD_S)


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 23, 61)]


def completion(c: openai.OpenAI, prompt, stream: bool) -> str:
    kw = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return c.completions.create(**kw).choices[0].text
    return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)


def chat(c: openai.OpenAI) -> str:
    chunks = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say something long."}],
                                       max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True})
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def free(core_stats: dict) -> int:
    """A core's free blocks; a core that has not reported yet (never stepped) has them all."""
    return core_stats.get("num_free_kv_blocks", core_stats["num_kv_blocks"])


def idle_and_whole(s: LiveServer) -> dict:
    """The P/D engine's stats once nothing runs and every pool is whole (bounded wait)."""
    for _ in range(int(HANG_GUARD_S / 0.05)):
        st = s.stats()
        if st["num_streams"] == 0 and st["transfer_files"] == 0 and all(
                c["num_running"] + c["num_waiting"] == 0 and free(c) == c["num_kv_blocks"]
                for c in st["cores"]):
            break
        time.sleep(0.05)
    return st


def test_same_tokens_as_colocated(servers):
    colo, pds = servers
    with client(colo) as a, client(pds) as b:
        for stream in (False, True):
            want = [completion(a, p, stream) for p in prompts()]
            assert [completion(b, p, stream) for p in prompts()] == want
        assert chat(b) == chat(a)
    s = idle_and_whole(pds)
    [prefill], [decode] = s["prefill"], s["decode"]
    assert prefill["role"] == "prefill" and decode["role"] == "decode"
    assert decode["kv_transfer_imported_requests"] >= 7 and decode["kv_transfer_misses"] == 0
    assert prefill["kv_transfer_exported_requests"] == decode["kv_transfer_imported_requests"]


@pytest.mark.parametrize("chunks_read", [0, 3], ids=["during-prefill", "during-decode"])
def test_client_leaving_mid_stream_leaves_every_pool_whole(servers, chunks_read):
    _, pds = servers
    body = {"model": MODEL, "prompt": prompts()[2], "max_tokens": 150, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=HANG_GUARD_S) as h:
        with h.stream("POST", pds.base_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(chunks_read):
                while not next(lines).startswith("data: "):
                    pass
    s = idle_and_whole(pds)
    assert s["num_streams"] == 0 and s["transfer_files"] == 0
    assert all(free(c) == c["num_kv_blocks"] for c in s["cores"]), s["cores"]
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"] == 2 * ENGINE_KW["num_kv_blocks"]
    import os

    assert os.listdir(pds.engine.transfer_dir) == []


def test_health_and_metrics(servers):
    _, pds = servers
    assert httpx.get(pds.base_url + "/health").json() == {"status": "ok"}
    text = httpx.get(pds.base_url + "/metrics").text
    assert f"asyncengine_kv_cache_blocks {2 * ENGINE_KW['num_kv_blocks']:.1f}" in text
    assert 'asyncengine_core_kv_cache_usage_ratio{core="1"}' in text
    assert "asyncengine_engine_cores_alive 2.0" in text and "asyncengine_engine_errored 0.0" in text


def test_warm_up_runs_through_both_cores(servers):
    _, pds = servers
    before = pds.stats()["decode"][0]["kv_transfer_imported_requests"]
    assert pds.run(warm_up(pds.engine)) > 0
    s = idle_and_whole(pds)
    assert s["decode"][0]["kv_transfer_imported_requests"] == before + 1
    assert all(free(c) == c["num_kv_blocks"] for c in s["cores"])
