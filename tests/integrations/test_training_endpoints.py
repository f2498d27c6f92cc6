"""The trainer's endpoints (integrations/openai_server/training.py): off by default (404), refused
without an API key, 401 without the key; /pause, /update_weights (from a checkpoint under the
weights folder only), /resume, /sleep, /wake_up and /reset_prefix_cache drive the engine, and a
completion after the update answers with the new weights' tokens."""
from __future__ import annotations

import shutil

import httpx
import pytest

from asyncengine import LLM, SamplingParams
from live_server import API_KEY, MODEL, LiveServer, make_engine

PROMPT = [5, 17, 42, 99, 7]


def greedy_text(path: str, tokenizer: str) -> str:
    with LLM(path, dtype="float32", tokenizer=tokenizer, num_kv_blocks=64, max_model_len=256) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=6, temperature=0.0,
                                                                          ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].text


def test_off_by_default_and_needs_a_key(tiny_llama_dir):
    s = LiveServer(make_engine(tiny_llama_dir, num_kv_blocks=64), api_key=API_KEY, own_engine=True).start()
    try:
        r = httpx.post(s.base_url + "/pause", json={}, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 404
    finally:
        s.stop()
    with pytest.raises(ValueError, match="API key"):
        LiveServer(make_engine(tiny_llama_dir, num_kv_blocks=64), training_endpoints=True)


def test_trainer_drives_the_server(tiny_llama_dir, tiny_model_dir, tmp_path):
    b = tiny_model_dir("llama", seed=1, tie_word_embeddings=False)
    root = tmp_path / "weights"
    shutil.copytree(b, root / "step1")
    want_a, want_b = greedy_text(tiny_llama_dir, tiny_llama_dir), greedy_text(b, tiny_llama_dir)
    assert want_a != want_b
    s = LiveServer(make_engine(tiny_llama_dir, num_kv_blocks=64), api_key=API_KEY, own_engine=True,
                   training_endpoints=True, training_weights_dir=str(root)).start()
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def post(path: str, body: dict | None = None, key: bool = True) -> httpx.Response:
        return httpx.post(s.base_url + path, json=body or {}, headers=auth if key else {}, timeout=120)

    def complete() -> str:
        r = post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
                                     "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    try:
        assert complete() == want_a
        assert post("/pause", key=False).status_code == 401
        assert post("/pause", {"mode": "sometime"}).status_code == 400
        assert post("/pause", {"mode": "keep"}).json() == {"weights_version": 0, "is_paused": True,
                                                           "is_sleeping": False}
        assert post("/update_weights", {"path": "/etc"}).status_code == 403
        assert post("/update_weights", {"path": "../"}).status_code == 403
        assert post("/update_weights", {"path": "nothing-here"}).status_code == 400
        r = post("/update_weights", {"path": "step1"})
        assert r.status_code == 200 and r.json()["weights_version"] == 1
        assert post("/resume").json()["is_paused"] is False
        assert complete() == want_b
        assert post("/sleep", {"level": 1}).json()["is_sleeping"] is True
        assert post("/wake_up", {"tags": ["kv_cache", "weights"]}).json()["is_sleeping"] is False
        assert post("/reset_prefix_cache").status_code == 200
        assert complete() == want_b
    finally:
        s.stop()
