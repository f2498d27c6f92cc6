"""pause_generation / resume_generation (engine/pause.py) around update_weights: "keep" parks 8
streams with their KV, an update lands, and after the resume all 8 finish, every token carrying the
weights version that produced it (the version-0 tokens are A's greedy tokens), no KV block leaked;
"abort" ends the running streams with finish_reason "abort"; "wait" returns only once they
finished; a request made while paused waits for the resume."""
from __future__ import annotations

import asyncio

import pytest
from safetensors.torch import load_file

from asyncengine import AsyncLLMEngine, EngineConfig, SamplingParams
from asyncengine.sampling_params import OutputKind
from model_utils import random_requests

PROMPTS = [ids for ids, _ in random_requests(8, 512, seed=11, plen=(3, 20), olen=(1, 2))]
COMMON = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=256, num_threads=1,
              freeze_gc_after_load=False, max_num_seqs=8)
GUARD_S = 240.0
N = 24


@pytest.fixture(scope="module")
def ab(tiny_model_dir):
    return tiny_model_dir("llama", seed=0, tie_word_embeddings=False), tiny_model_dir("llama", seed=1)


def delta(n: int = N) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, output_kind=OutputKind.DELTA)


async def collect(stream, first: asyncio.Event | None = None) -> list:
    chunks = []
    async for out in stream:
        chunks.append(out)
        if first is not None:
            first.set()
    return chunks


async def test_keep_update_resume(ab):
    a, b = ab
    async with AsyncLLMEngine(EngineConfig(model=a, **COMMON)) as eng:
        ref = [(await eng.complete({"prompt_token_ids": p}, delta())).outputs[0].token_ids for p in PROMPTS]
        started = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.create_task(collect(eng.generate({"prompt_token_ids": p}, delta()), started[i]))
                 for i, p in enumerate(PROMPTS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), GUARD_S)
        await eng.pause_generation("keep")
        assert eng.is_paused
        assert not any(t.done() for t in tasks)  # parked, not ended
        await eng.update_weights(load_file(f"{b}/model.safetensors"))
        late = asyncio.create_task(eng.complete({"prompt_token_ids": PROMPTS[0]}, delta(4)))
        await asyncio.sleep(0.2)
        assert not late.done()  # a new request waits for the resume
        await eng.resume_generation()
        results = await asyncio.wait_for(asyncio.gather(*tasks, late), GUARD_S)
        spans = set()
        for i, chunks in enumerate(results[:-1]):
            toks = [t for c in chunks for t in c.outputs[0].token_ids]
            versions = [v for c in chunks for v in c.outputs[0].weights_versions]
            assert len(toks) == len(versions) == N and chunks[-1].finished
            assert versions == sorted(versions)
            assert all(c.weights_version == c.outputs[0].weights_versions[-1] for c in chunks if c.outputs[0].token_ids)
            old = versions.count(0)
            assert toks[:old] == ref[i][:old]  # the tokens before the update are A's
            spans |= set(versions)
        assert spans == {0, 1}
        assert set(results[-1].outputs[0].weights_versions) == {1}
        core = eng.core
        assert core.kv.num_free_blocks == core.num_blocks  # no block leaked
        core.kv.pool.check_invariants()


async def test_abort_and_wait(ab):
    a, _ = ab
    async with AsyncLLMEngine(EngineConfig(model=a, **COMMON)) as eng:
        started = [asyncio.Event() for _ in range(4)]
        tasks = [asyncio.create_task(collect(eng.generate({"prompt_token_ids": PROMPTS[i]}, delta(200)), started[i]))
                 for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), GUARD_S)
        await eng.pause_generation("abort")
        results = await asyncio.wait_for(asyncio.gather(*tasks), GUARD_S)
        assert all(r[-1].finish_reason == "abort" for r in results)
        await eng.resume_generation()
        assert not eng.is_paused

        started = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(collect(eng.generate({"prompt_token_ids": PROMPTS[i]}, delta(16)), started[i]))
                 for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), GUARD_S)
        await asyncio.wait_for(eng.pause_generation("wait"), GUARD_S)
        assert all(t.done() for t in tasks)
        assert all(t.result()[-1].finish_reason == "length" for t in tasks)
        await eng.resume_generation()
        assert eng.core.kv.num_free_blocks == eng.core.num_blocks


async def test_bad_mode(ab):
    async with AsyncLLMEngine(EngineConfig(model=ab[0], **COMMON)) as eng:
        with pytest.raises(ValueError, match="keep"):
            await eng.pause_generation("later")
        assert not eng.is_paused
