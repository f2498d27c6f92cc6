"""One rule for sampling defaults (models/sampling_defaults.py): the same prompt with no sampling
fields gives the same tokens through ``LLM``, ``AsyncLLMEngine``, the CLI and the server, and
they are the model's generation config's, not SamplingParams' field values."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from asyncengine import LLM, SamplingParams
from live_server import MODEL, LiveServer, make_engine

PROMPT = "Tell me a joke."
N = 12
ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


@pytest.fixture(scope="module")
def model_with_own_defaults(tiny_llama_dir, tmp_path_factory) -> str:
    """The tiny llama with a generation config that asks for greedy decoding with a repetition
    penalty: defaults that are neither SamplingParams' field values nor the engine's table."""
    d = tmp_path_factory.mktemp("own-defaults") / "m"
    shutil.copytree(tiny_llama_dir, d)
    path = d / "generation_config.json"
    gc = json.loads(path.read_text()) if path.exists() else {}
    gc.update(do_sample=False, repetition_penalty=1.3)
    path.write_text(json.dumps(gc))
    return str(d)


def test_every_front_end_decodes_unset_fields_with_the_models_defaults(model_with_own_defaults):
    d = model_with_own_defaults
    with LLM(d, dtype="float32", num_kv_blocks=64) as llm:
        (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=N), use_tqdm=False)
        (own,) = llm.generate(PROMPT, SamplingParams(max_tokens=N, temperature=0.0, repetition_penalty=1.3,
                                                     presence_penalty=0.0), use_tqdm=False)
        (table,) = llm.generate(PROMPT, SamplingParams(max_tokens=N, temperature=0.0, presence_penalty=0.3),
                                use_tqdm=False)
    ids, text = out.outputs[0].token_ids, out.outputs[0].text
    assert ids == own.outputs[0].token_ids  # the model's generation config, as if given
    assert ids != table.outputs[0].token_ids  # not the engine's table: the model's config comes first

    server = LiveServer(make_engine(d), own_engine=True).start()
    try:
        engine_out = server.run(server.engine.complete(PROMPT, SamplingParams(max_tokens=N)))
        assert engine_out.outputs[0].token_ids == ids
        import httpx

        r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": N},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text
    finally:
        server.stop()

    r = subprocess.run([sys.executable, "-m", "asyncengine", "generate", "--model", d, "--prompt", PROMPT,
                        "--max-tokens", str(N), "--dtype", "float32", "--num-kv-blocks", "64"],
                       capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == text
