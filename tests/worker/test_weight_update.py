"""update_weights on every rank and core (worker/weight_update.py through the executor's
collective_rpc; engine_core/core_control.py for data parallel): after an update to checkpoint B the
engine's greedy tokens equal a fresh single-process engine on B, token-exact, at TP=2 (mp and Ray),
PP=2 and DP=2; a refused update (a shape only one layout would accept) changes no rank."""
from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from asyncengine import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from asyncengine.errors import WeightUpdateError
from model_utils import random_requests

REQUESTS = random_requests(3, 512, seed=9, plen=(3, 30), olen=(4, 8))
COMMON = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=128, num_threads=1,
              freeze_gc_after_load=False)
HANG_GUARD_S = 240.0


@pytest.fixture(scope="module")
def ab(tiny_model_dir):
    """(A dir, B dir, A's greedy tokens, B's greedy tokens), the references from one process."""
    a, b = tiny_model_dir("llama", seed=0, tie_word_embeddings=False), tiny_model_dir("llama", seed=1)
    refs = []
    for d in (a, b):
        with LLM(d, **COMMON) as llm:
            refs.append(greedy(llm))
    assert refs[0] != refs[1]
    return a, b, refs[0], refs[1]


def params():
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in REQUESTS]


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in REQUESTS], params(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


async def agreedy(eng: AsyncLLMEngine) -> list[list[int]]:
    async def one(i):
        return await eng.complete({"prompt_token_ids": REQUESTS[i][0]}, params()[i])
    outs = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(REQUESTS)))), HANG_GUARD_S)
    return [o.outputs[0].token_ids for o in outs]


def bad_update(b: str) -> dict[str, torch.Tensor]:
    """B with one tensor cut to the size of a TP=2 rank's slice: only the full shape is right."""
    sd = load_file(f"{b}/model.safetensors")
    w = sd["model.layers.1.mlp.gate_proj.weight"]
    sd["model.layers.1.mlp.gate_proj.weight"] = w[: w.shape[0] // 2]
    return sd


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_mp_ranks_take_the_update(ab, layout):
    a, b, want_a, want_b = ab
    with LLM(a, **COMMON, distributed_executor_backend="mp", **layout) as llm:
        assert greedy(llm) == want_a
        with pytest.raises(WeightUpdateError):
            llm.update_weights(bad_update(b))
        assert greedy(llm) == want_a
        llm.update_weights(load_file(f"{b}/model.safetensors"))
        assert greedy(llm) == want_b
        llm.update_weights(a)  # a path: each rank reads its own slices
        assert greedy(llm) == want_a


def test_pp2_refuses_a_name_no_stage_holds(ab):
    a, b, want_a, _ = ab
    sd = load_file(f"{b}/model.safetensors")
    sd["model.layers.7.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"]
    with LLM(a, **COMMON, pipeline_parallel_size=2) as llm:
        with pytest.raises(WeightUpdateError, match="no such tensor"):
            llm.update_weights(sd)
        assert greedy(llm) == want_a


async def test_dp2_cores_take_the_update(ab):
    a, b, want_a, want_b = ab
    eng = AsyncLLMEngine(EngineConfig(model=a, data_parallel_size=2, **COMMON))
    async with eng:
        with pytest.raises(WeightUpdateError):
            await eng.update_weights(bad_update(b))
        assert await agreedy(eng) == want_a and eng.weights_version == 0
        # two streams parked on their cores through an update ("keep"), then finished on B
        streams = [eng.generate({"prompt_token_ids": REQUESTS[i][0]}, SamplingParams(
            max_tokens=40, temperature=0.0, ignore_eos=True)) for i in range(2)]
        firsts = [await asyncio.wait_for(s.__anext__(), HANG_GUARD_S) for s in streams]
        await eng.pause_generation("keep")
        assert await eng.update_weights(load_file(f"{b}/model.safetensors")) == 1
        await eng.resume_generation()
        for s, first in zip(streams, firsts):
            last = first
            async for last in s:
                pass
            assert last.finished and len(last.outputs[0].token_ids) == 40
            assert set(last.outputs[0].weights_versions) <= {0, 1} and last.outputs[0].weights_versions[-1] == 1
        outs = await agreedy(eng)
        assert outs == want_b
        await eng.reset_prefix_cache()


async def test_ray_tp2_ranks_take_the_update(ray_cluster, ab):
    a, b, want_a, want_b = ab
    eng = AsyncLLMEngine(EngineConfig(model=a, tensor_parallel_size=2, distributed_executor_backend="ray",
                                      **COMMON))
    async with eng:
        assert await agreedy(eng) == want_a
        await eng.update_weights(b)
        assert await agreedy(eng) == want_b
