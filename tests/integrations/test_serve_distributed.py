"""``asyncengine serve`` with tensor parallelism (two worker processes), with data parallelism
(two engine-core processes) and disaggregated prefill/decode (a prefill and a decode core): the
official openai client gets the same greedy answer as an in-process TP=1 engine, /metrics labels
the cores, and Ctrl-C leaves no process behind (nor, for P/D, a transfer folder)."""
from __future__ import annotations

import os

import httpx
import openai
import pytest

from live_server import HANG_GUARD_S
from proc_utils import descendants
from test_cli_serve import running_serve

PROMPT = [5, 17, 33, 101, 7, 64]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    from asyncengine import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].text


@pytest.mark.parametrize("flags,workers", [
    (["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"], 2),
    (["--data-parallel-size", "2"], 2),
    (["--prefill-cores", "1", "--decode-cores", "1"], 2),
], ids=["tp2-mp", "dp2", "pd1+1"])
def test_serve_distributed(tiny_llama_dir, tmp_path, reference, flags, workers):
    with running_serve(tiny_llama_dir, tmp_path, "--dtype", "float32", "--max-model-len", "256",
                       "--num-threads", "1", *flags) as (proc, base):
        below = descendants(proc.pid)
        assert len(below) >= workers, below  # worker / engine-core processes (and their workers)
        with openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=HANG_GUARD_S) as c:
            [model] = c.models.list().data
            texts = [c.completions.create(model=model.id, prompt=PROMPT, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text for _ in range(3)]
            assert texts == [reference] * 3
            r = c.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 4
            chunks = list(c.completions.create(model=model.id, prompt=PROMPT, max_tokens=8, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == reference
        metrics = httpx.get(base + "/metrics").text
        if "--data-parallel-size" in flags or "--prefill-cores" in flags:
            assert 'asyncengine_core_num_requests_running{core="1"}' in metrics
    from proc_utils import wait_gone

    wait_gone(below)  # no worker or engine-core process left behind
    if "--prefill-cores" in flags:  # the server's folder of transfer files went with it
        from asyncengine.kv_connector.pd.transfer_file import default_dir

        assert not [n for n in os.listdir(default_dir()) if n.startswith(f"pd-{proc.pid}-")]
