"""PDEngine's trainer controls (engine/pd_client.py): update_weights is staged on the prefill and
the decode core before either commits, and after it the disaggregated engine answers with the new
weights' tokens (those of a colocated engine on them); a refused update changes neither core;
pause/resume reach both sides. (No sleep: a P/D core's KV connector holds its cache.)"""
from __future__ import annotations

import dataclasses

import asyncio

import pytest
from safetensors.torch import load_file

from asyncengine import LLM, EngineConfig, SamplingParams
from asyncengine.engine.async_engine import AsyncLLMEngine
from asyncengine.errors import WeightUpdateError

PROMPT = list(range(20, 60))  # long enough to take the hop
GUARD_S = 180.0


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


async def test_pd_update_pause_sleep(tiny_model_dir, tmp_path):
    a, b = tiny_model_dir("llama", seed=0, tie_word_embeddings=False), tiny_model_dir("llama", seed=1)
    refs = []
    for d in (a, b):
        with LLM(d, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64, block_size=8) as llm:
            refs.append(llm.generate([{"prompt_token_ids": PROMPT}], greedy(), use_tqdm=False)[0].outputs[0].token_ids)
    config = EngineConfig(model=a, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64, block_size=8,
                          kv_transfer_dir=str(tmp_path), prefill_cores=1, decode_cores=1)

    async def run(pd) -> list[int]:
        out = await asyncio.wait_for(pd.complete({"prompt_token_ids": PROMPT}, greedy()), GUARD_S)
        return out.outputs[0].token_ids

    async with AsyncLLMEngine.from_config(dataclasses.replace(config, pd_skip_hop_below=8)) as pd:
        assert await run(pd) == refs[0]
        sd = load_file(f"{b}/model.safetensors")
        with pytest.raises(WeightUpdateError):
            await pd.update_weights({k: v for k, v in sd.items() if "layers.1." not in k})
        assert await run(pd) == refs[0] and pd.weights_version == 0
        await pd.pause_generation("wait")
        assert pd.is_paused
        assert await pd.update_weights(sd) == 1
        await pd.resume_generation()
        assert await run(pd) == refs[1]
