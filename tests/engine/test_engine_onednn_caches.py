"""A started engine bounds oneDNN's per-shape primitive caches before its first GEMM
(asyncengine/platforms/onednn_caches.py; issue 22: unbounded, a bf16 server's RSS grew ~650 MB
with the number of distinct batch sizes it saw).

In a fresh process with neither variable set: an engine in bf16 is built and generates (its
warm-up and steps run oneDNN GEMMs), then the same process runs bf16 GEMMs of 2 x CAPACITY new row
counts and the first one again. Only if the capacity was in the environment before the engine's
first GEMM created the caches is the first shape evicted and compiled again (oneDNN's verbose log:
create:cache_miss; unbounded, a cache_hit)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from asyncengine.platforms.onednn_caches import CAPACITY, VARIABLES

_SCRIPT = r"""
import ctypes, json, os, sys
from asyncengine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=128, num_kv_blocks=64, num_threads=1)
llm.generate([[5] * n for n in (3, 17, 40)], SamplingParams(max_tokens=4), use_tqdm=False)
env = {name: os.environ.get(name) for name in json.loads(sys.argv[2])}
import torch
w = torch.randn(64, 64, dtype=torch.bfloat16); x = torch.randn(1024, 64, dtype=torch.bfloat16)
torch.nn.functional.linear(x[:2], w)  # one row is a GEMV, not oneDNN
for m in range(3, 3 + int(sys.argv[3])):
    torch.nn.functional.linear(x[:m], w)
ctypes.CDLL(None).fflush(None); print("MARK", flush=True)  # oneDNN logs via C stdio
torch.nn.functional.linear(x[:2], w)  # one row is a GEMV, not oneDNN
ctypes.CDLL(None).fflush(None)
print(json.dumps(env), flush=True)
"""


@pytest.mark.slow
def test_started_engine_bounds_the_caches_before_its_first_gemm(tiny_llama_dir):
    env = {**os.environ, "ONEDNN_VERBOSE": "profile_create", "TOKENIZERS_PARALLELISM": "false"}
    for name in VARIABLES:
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-c", _SCRIPT, tiny_llama_dir, json.dumps(VARIABLES), str(2 * CAPACITY)],
                         env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout.splitlines()
    assert json.loads(out[-1]) == {name: str(CAPACITY) for name in VARIABLES}
    created = [ln for ln in out if ln.startswith("onednn_verbose") and ",create:" in ln]
    if not created:
        pytest.skip("bf16 GEMMs do not run through oneDNN on this CPU (no primitive created)")
    after = [ln for ln in out[out.index("MARK"):] if ln.startswith("onednn_verbose") and ",create:cache_miss," in ln]
    assert after, "the first shape outlived 2 x CAPACITY others: the caches were created unbounded"
