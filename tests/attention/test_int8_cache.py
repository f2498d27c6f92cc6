"""The 8-bit KV cache in the engine (attention/int8_cache.py, ``kv_cache_dtype="int8"``): the
blocks a memory budget buys, greedy decoding against the fp32 cache within a stated logprob
tolerance (8 bits are lossy: no token-exact claim), prefix-cache hits, preemption, the torch
backend and the torch fallback, and the refusals.

Tolerance: on the tiny llama (head_dim 64, random weights) the chosen tokens' logprobs stay
within LOGPROB_TOL of the fp32 cache's wherever the tokens agree, and a first divergence is
allowed only where the fp32 run's top-2 logprob margin is below MARGIN_TOL.
"""
from __future__ import annotations

import random

import pytest

from asyncengine import LLM, EngineConfig, SamplingParams
from asyncengine.errors import ConfigError

LOGPROB_TOL = 0.05
MARGIN_TOL = 0.1
COMMON = dict(dtype="float32", num_threads=1, max_model_len=256)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", head_dim=64)  # the default model's head dim: the AVX-512 path


def prompts(n=5, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(5, 60))] for _ in range(n)]


def run(llm, ps, max_tokens=12):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def assert_close(got, want):
    """Tokens equal up to a first divergence at a near-tie of the reference; logprobs within tolerance."""
    for g, w in zip(got, want):
        for j, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
            lp_w = w.logprobs[j]
            if a != b:
                top = sorted((lp.logprob for lp in lp_w.values()), reverse=True)
                assert top[0] - top[1] < MARGIN_TOL, f"diverged at {j} where the margin is {top[0] - top[1]:.3f}"
                break
            assert abs(g.logprobs[j][a].logprob - lp_w[b].logprob) < LOGPROB_TOL, (j, g.logprobs[j][a], lp_w[b])


@pytest.fixture(scope="module")
def reference(model_dir):
    with LLM(model_dir, attention_backend="cpu", **COMMON) as llm:
        return run(llm, prompts())


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_close_to_fp32_cache(model_dir, reference, backend):
    with LLM(model_dir, attention_backend=backend, kv_cache_dtype="int8", **COMMON) as llm:
        assert_close(run(llm, prompts()), reference)


def test_torch_fallback_without_kernels(model_dir, reference, kernels_off):
    with LLM(model_dir, attention_backend="cpu", kv_cache_dtype="int8", **COMMON) as llm:
        assert_close(run(llm, prompts()[:2]), reference[:2])


def test_blocks_double_in_the_same_memory(model_dir):
    budget = 4 * 2**20
    blocks = {}
    for kv in ("auto", "int8"):
        with LLM(model_dir, dtype="bfloat16", kv_cache_bytes=budget, kv_cache_dtype=kv, num_threads=1) as llm:
            blocks[kv] = llm.engine.stats()["num_kv_blocks"]
    # a bf16 row of 64 values is 128 bytes, an int8 row 64 + a 2-byte scale
    assert blocks["int8"] == pytest.approx(blocks["auto"] * 128 / 66, rel=0.01), blocks
    assert blocks["int8"] >= 1.9 * blocks["auto"]


def test_prefix_hits_and_preemption(model_dir, reference):
    ps = prompts()
    shared = [ps[0] + p for p in prompts(3, seed=1)]
    with LLM(model_dir, attention_backend="cpu", kv_cache_dtype="int8", **COMMON) as llm:
        first = run(llm, shared)
        again = run(llm, shared)  # every prompt's blocks now come from the prefix cache
        assert llm.engine.stats()["prefix_cache_hits"] > 0
        assert_close(again, first)
    # a cache too small for the batch at once: requests are preempted and recomputed
    with LLM(model_dir, attention_backend="cpu", kv_cache_dtype="int8", num_kv_blocks=10, block_size=16,
             max_num_batched_tokens=64, **COMMON) as llm:
        small = run(llm, ps, max_tokens=40)
        assert llm.engine.stats()["num_preemptions"] > 0
        assert llm.engine.stats()["num_free_kv_blocks"] == 10  # no leaked block
    assert_close(small, reference)


@pytest.mark.parametrize("kw,says", [
    (dict(kv_cache_dtype="fp8"), "'auto'"),
    (dict(kv_cache_dtype="int8", attention_backend="triton"), "triton"),
    (dict(kv_cache_dtype="int8", device="cuda"), "CPU only"),
    (dict(kv_cache_dtype="int8", batch_invariant=True), "batch invariant"),
])
def test_refusals(kw, says):
    with pytest.raises(ConfigError, match=says):
        EngineConfig(**kw)
