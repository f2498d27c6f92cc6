"""LLM.score / AsyncLLMEngine.score (engine/scoring.py): in batch-invariant mode the logprob the
sampler reports for each sampled token equals, bitwise, the score of the same prompt + completion,
for 64 sampled completions made in batches of mixed sizes, with chunked prefill (16-token budget)
and prefix-cache hits (prompts sharing a 40-token prefix), scored in one batch. The default mode's
largest difference is printed (docs/training.md reports it)."""
from __future__ import annotations

import random

import pytest

from asyncengine import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from asyncengine.errors import InvalidRequestError

GROUPS = (1, 3, 8, 16, 36)  # 64 completions in batches of these sizes
COMMON = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=256, max_model_len=256, num_threads=1,
              freeze_gc_after_load=False, max_num_batched_tokens=16, seed=0)


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    prefix = [rng.randrange(3, 512) for _ in range(40)]
    return [prefix + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))] for _ in range(8)]


def sample_and_score(llm: LLM) -> list[tuple[list[float], list[float]]]:
    ps = prompts()
    made = []
    i = 0
    for size in GROUPS:
        batch = [ps[(i + j) % len(ps)] for j in range(size)]
        params = [SamplingParams(max_tokens=12, temperature=1.0, seed=100 + i + j, logprobs=0, ignore_eos=True)
                  for j in range(size)]
        for p, out in zip(batch, llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)):
            c = out.outputs[0]
            made.append((p, c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]))
        i += size
    assert len(made) == 64
    scores = llm.score([m[0] for m in made], [m[1] for m in made])
    return [(m[2], s) for m, s in zip(made, scores)]


def test_sampled_logprobs_equal_the_score_bitwise(tiny_llama_dir):
    with LLM(tiny_llama_dir, batch_invariant=True, **COMMON) as llm:
        pairs = sample_and_score(llm)
        assert llm.engine.kv.prefix_hits > 0
    for sampled, scored in pairs:
        assert sampled == scored  # float equality: bitwise


def test_default_mode_difference(tiny_llama_dir):
    with LLM(tiny_llama_dir, **COMMON) as llm:
        pairs = sample_and_score(llm)
    worst = max(abs(a - b) for sampled, scored in pairs for a, b in zip(sampled, scored))
    print(f"[score] default mode: largest |sampled - scored| logprob difference {worst:.3g}")
    assert worst < 1e-3


def test_single_pair_and_bad_input(tiny_llama_dir):
    with LLM(tiny_llama_dir, **COMMON) as llm:
        one = llm.score([5, 6, 7], [8, 9])
        assert len(one) == 2 and all(x <= 0 for x in one)
        with pytest.raises(InvalidRequestError):
            llm.score([5, 6], [])
        with pytest.raises(InvalidRequestError):
            llm.score([5, 6], [1.5])


async def test_async_score_matches_llm(tiny_llama_dir):
    with LLM(tiny_llama_dir, **COMMON) as llm:
        want = llm.score([5, 6, 7, 8], [9, 10, 11])
    async with AsyncLLMEngine(EngineConfig(model=tiny_llama_dir, **COMMON)) as eng:
        assert await eng.score([5, 6, 7, 8], [9, 10, 11]) == want
