"""The engine on a CUDA GPU (skipped without one: "needs CUDA"): greedy fp32 parity with
transformers through the triton backend, CUDA graphs giving the eager tokens, the KV cache sized
from the profiling run. benchmarks/gpu_check.py runs these on the GPU machine."""
from __future__ import annotations

import pytest
import torch

from asyncengine import LLM, SamplingParams
from model_utils import compare

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REGIMES = {
    "chunked": dict(num_kv_blocks=256, block_size=8, max_num_batched_tokens=16),
    "preempt": dict(num_kv_blocks=24, block_size=4),
}


def runner(llm):
    from worker_hooks import runner_of

    return llm.engine.collective_rpc(runner_of)[0]


def greedy_run(llm, requests):
    sps = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in requests]
    outs = llm.generate([list(p) for p, _ in requests], sps, use_tqdm=False)
    eng = llm.engine
    assert eng.kv.num_free_blocks == eng.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("regime", list(REGIMES))
def test_cuda_triton_parity_with_transformers(regime, tiny_model_dir, tiny_reference):
    requests, refs = tiny_reference("llama")
    llm = LLM(tiny_model_dir("llama"), dtype="float32", device="cuda", **REGIMES[regime])
    assert llm.config.attention_backend_name == "triton"
    assert runner(llm).graphs is not None, "decode CUDA graphs were not captured"
    counts = compare(greedy_run(llm, requests), refs)
    assert counts["exact"] + counts["near_tie"] == len(requests)


def test_cuda_graphs_match_eager(tiny_model_dir, tiny_reference):
    requests, _ = tiny_reference("qwen3")
    d = tiny_model_dir("qwen3")
    eager = LLM(d, dtype="float32", device="cuda", enforce_eager=True, num_kv_blocks=256)
    assert runner(eager).graphs is None
    graphs = LLM(d, dtype="float32", device="cuda", num_kv_blocks=256)
    assert greedy_run(graphs, requests) == greedy_run(eager, requests)


def test_kv_cache_sized_from_free_memory(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3,
              max_num_seqs=8, max_model_len=512)
    cap = 8 * (512 // llm.config.block_size) + 1  # the full-length bound binds for a tiny model
    assert 2 <= llm.engine.num_blocks <= cap
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
