"""Parity with transformers beyond the standard workload of test_parity.py:

* logprobs (sampled tokens' and prompt tokens') equal transformers' ``log_softmax`` on every
  architecture (llama, mistral, qwen2, qwen3), under chunked prefill;
* sequences past 512 tokens (prompts up to 600, decodes past 512), token-exact, with a generous
  cache and with a small one (chunked prefill and preemption at those lengths);
* sliding-window attention with a window (16) much shorter than the sequences (up to 84 tokens):
  Mistral (every layer slides) and Qwen2 with ``max_window_layers`` (only the later layers slide),
  in the three cache regimes of test_parity.py.

fp32, greedy where tokens are compared, tiny random-weight checkpoints of conftest.py.
"""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from asyncengine import LLM, SamplingParams
from asyncengine.core.sliding_window_kv_cache_manager import SlidingWindowKVCacheManager
from model_utils import check_entry, compare, ref_logprobs
from test_parity import REGIMES, check_no_leak, run

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
VOCAB = 512

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_transformers(arch, tiny_model_dir):
    d = tiny_model_dir(arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    llm = LLM(d, dtype="float32", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)
    prompts = [tokens(1, 37), tokens(2, 6)]
    params = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, prompt_logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=1.0, seed=3, logprobs=2, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outs):
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == sp.max_tokens
        ref = ref_logprobs(hf, prompt + list(c.token_ids))  # teacher-forced on the engine's tokens
        for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            check_entry(entry, tok, ref[len(prompt) - 1 + i], sp.logprobs)
        if sp.prompt_logprobs is not None:
            plp = out.prompt_logprobs
            assert len(plp) == len(prompt) and plp[0] is None
            for j in range(1, len(prompt)):
                check_entry(plp[j], prompt[j], ref[j - 1], sp.prompt_logprobs)
    check_no_leak(llm)


# prompt length, output length: a 600-token prompt, a prompt that crosses 512 while decoding, and a
# short prompt whose decode runs past 512
LONG = [(600, 12), (500, 30), (40, 490)]


@pytest.mark.parametrize("regime", ["generous", "small-cache"])
def test_long_sequences_past_512(regime, tiny_model_dir, hf_reference):
    d = tiny_model_dir("llama")
    requests = [(tokens(100 + i, p), m) for i, (p, m) in enumerate(LONG)]
    refs = hf_reference(d, requests)
    opts = {"generous": dict(num_kv_blocks=128, block_size=16),
            # 48 blocks of 16 = 768 slots for three requests of 530-612 tokens
            "small-cache": dict(num_kv_blocks=48, block_size=16, max_num_batched_tokens=64)}[regime]
    llm = LLM(d, dtype="float32", **opts)
    counts = compare(run(llm, requests), refs)
    assert counts["exact"] + counts["near_tie"] == len(requests)
    assert max(len(p) + m for p, m in requests) > 512
    if regime == "small-cache":
        assert llm.engine.stats()["num_preemptions"] > 0


SLIDING = {"mistral": dict(sliding_window=16),
           "qwen2": dict(sliding_window=16, use_sliding_window=True, max_window_layers=1)}


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("arch", list(SLIDING))
def test_sliding_window_shorter_than_the_sequence(arch, regime, tiny_model_dir, tiny_reference, hf_reference):
    d = tiny_model_dir(arch, **SLIDING[arch])
    requests, refs = tiny_reference(arch, **SLIDING[arch])
    llm = LLM(d, dtype="float32", **REGIMES[regime])
    assert llm.engine.max_model_len > 16  # the model serves past its window
    from worker_hooks import attention_windows

    windows = llm.engine.collective_rpc(attention_windows)[0]
    assert windows == ([16, 16] if arch == "mistral" else [None, 16])
    # every layer slides: out-of-window blocks go back to the pool; mixed: one table keeps them all
    sliding = isinstance(llm.engine.kv, SlidingWindowKVCacheManager)
    assert sliding == (arch == "mistral")
    got = run(llm, requests)
    counts = compare(got, refs)
    assert counts["exact"] + counts["near_tie"] == len(requests)
    # the window matters: the same weights without it give other tokens for the long requests
    full = hf_reference(tiny_model_dir(arch), requests)
    assert sum(g != f.tokens for g, f in zip(got, full)) >= len(requests) // 3
    if regime == "preempt":
        assert llm.engine.stats()["num_preemptions"] > 0
