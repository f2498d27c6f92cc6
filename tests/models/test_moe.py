"""Mixture-of-experts models (models/moe.py) against transformers: greedy, fp32, EOS ignored,
token-exact except a first divergence at a reference near-tie (``model_utils.compare``).

Tiny random Mixtral, Qwen2-MoE (gated shared expert, no renormalisation), Qwen3-MoE (q/k norm,
renormalised top 2), OLMoE (q/k norm over all heads, clip_qkv), GraniteMoe (stacked experts, the
four Granite multipliers) and GraniteMoeHybrid with routed
experts beside its shared MLP (top k of the logits, softmaxed) and Nemotron-H with E layers (plain
squared-ReLU experts, grouped sigmoid router with a selection bias, scaled weights), 8 experts, top 2, hidden 64, 2 layers, on the standard 18-request workload in
the three regimes of test_parity (generous cache, 16-token chunked prefill, preemption) plus prefix
hits (the workload twice, prefix caching on). After every run no KV block is held.
"""
from __future__ import annotations

import pytest
import torch

from asyncengine import LLM, SamplingParams
from model_utils import MOE_ARCHS, compare

REGIMES = {
    "generous": dict(num_kv_blocks=256, block_size=16),
    "chunked": dict(num_kv_blocks=256, block_size=8, max_num_batched_tokens=16),
    "preempt": dict(num_kv_blocks=24, block_size=4),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(llm: LLM, requests) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in requests]
    outs = llm.generate([list(p) for p, _ in requests], params, use_tqdm=False)
    eng = llm.engine
    assert not eng.has_unfinished()
    assert eng.kv.num_free_blocks == eng.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("arch", (*MOE_ARCHS, "granitemoehybrid_moe", "nemotron_h_moe"))
def test_moe_parity(arch, regime, tiny_model_dir, tiny_reference):
    requests, refs = tiny_reference(arch)
    llm = LLM(tiny_model_dir(arch), dtype="float32", **REGIMES[regime])
    counts = compare(run(llm, requests), refs)
    print(f"[moe] {arch}/{regime}: {counts}")
    stats = llm.engine.stats()
    if regime == "preempt":
        assert stats["num_preemptions"] > 0


def test_moe_prefix_hits(tiny_model_dir, tiny_reference):
    requests, refs = tiny_reference("qwen2_moe")
    llm = LLM(tiny_model_dir("qwen2_moe"), dtype="float32", enable_prefix_caching=True, **REGIMES["generous"])
    compare(run(llm, requests), refs)
    compare(run(llm, requests), refs)  # the second pass reads the cached prefixes
    assert llm.engine.stats()["prefix_cache_hit_rate"] > 0


def test_moe_takes_the_torch_step(tiny_model_dir, caplog):
    """The native C decode step runs block-quantized experts only (GGUF files: test_gguf_moe.py);
    a safetensors checkpoint's dense experts keep the torch step, and the model says why (logged)."""
    import logging

    with caplog.at_level(logging.INFO, logger="asyncengine.models.llama_native"):
        llm = LLM(tiny_model_dir("mixtral"), dtype="float32", **REGIMES["generous"])
    assert any("torch step" in r.getMessage() and "mixture-of-experts" in r.getMessage() for r in caplog.records)
    reasons = llm.engine.collective_rpc(_native_reason)
    assert reasons and all("mixture-of-experts" in r and "dense" in r for r in reasons)


def _native_reason(worker):
    from asyncengine.models.llama_native import native_step_reason

    assert worker.model.native_step is None
    return native_step_reason(worker.model)


@pytest.mark.parametrize("ep", [False, True])
def test_rank_loads_its_experts(tiny_model_dir, ep):
    """Under TP each rank reads every expert's 1/N columns; under EP its 1/N of the experts whole."""
    from asyncengine.config import EngineConfig
    from asyncengine.layers.parallel import TPGroup
    from asyncengine.models.loader import load_model

    config = EngineConfig(model=tiny_model_dir("qwen2_moe"), dtype="float32", skip_tokenizer_init=True)
    full = load_model(config, tokenizer=False).model.layers[0].mlp
    for rank in range(2):
        tp = TPGroup(rank=rank, size=2, expert_parallel=ep)
        part = load_model(config, tp=tp, tokenizer=False).model.layers[0].mlp
        i = full.full_inter
        if ep:
            want = full.w13[rank * 4:(rank + 1) * 4]
        else:
            cols = slice(rank * i // 2, (rank + 1) * i // 2)
            want = torch.cat([full.w13[:, :i][:, cols], full.w13[:, i:][:, cols]], dim=1)
        assert torch.equal(part.w13, want)
        torch.testing.assert_close(part.gate.weight, full.gate.weight, rtol=0, atol=0)


# Qwen3-MoE: its worker ranks rebuild the config from to_dict(), where num_experts is only an alias
@pytest.mark.parametrize("arch,ep", [("qwen2_moe", False), ("qwen2_moe", True), ("qwen3_moe", True)])
def test_tensor_and_expert_parallel_match_one_rank(tiny_model_dir, tiny_reference, arch, ep):
    requests, refs = tiny_reference(arch)
    requests, refs = requests[:8], refs[:8]
    llm = LLM(tiny_model_dir(arch), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp",
              enable_expert_parallel=ep, num_threads=1, **REGIMES["chunked"])
    try:
        from worker_hooks import moe_local_experts

        assert llm.engine.collective_rpc(moe_local_experts) == [[4 if ep else 8] * 2] * 2
        counts = compare(run(llm, requests), refs)
        print(f"[moe] {arch}/tp2/ep={ep}: {counts}")
    finally:
        llm.shutdown()


def test_expert_load_in_stats(tiny_model_dir):
    """Tokens per expert (summed over the layers) reach stats(): every token goes to top_k experts
    in each of the 2 MoE layers."""
    llm = LLM(tiny_model_dir("mixtral"), dtype="float32", **REGIMES["generous"])
    assert "moe_expert_tokens" not in llm.engine.stats()
    run(llm, [([5, 6, 7, 8], 3), ([9, 10], 2)])
    s = llm.engine.stats()
    computed = (4 + 3 - 1) + (2 + 2 - 1)  # per request: prompt + outputs - the last (never fed back)
    assert len(s["moe_expert_tokens"]) == 8 and sum(s["moe_expert_tokens"]) == computed * 2 * 2
    assert sum(s["moe_last_step_expert_tokens"]) == 1 * 2 * 2  # the last step: one decode
    assert s["moe_expert_imbalance"] >= 1.0
    from asyncengine.integrations.openai_server.metrics import EngineCollector

    fams = {f.name: f for f in EngineCollector(llm.engine).collect()}
    per_expert = {x.labels["expert"]: x.value for x in fams["asyncengine_moe_expert_tokens"].samples}
    assert per_expert == {str(i): float(n) for i, n in enumerate(s["moe_expert_tokens"])}
    assert fams["asyncengine_moe_expert_imbalance"].samples[0].value == s["moe_expert_imbalance"]


def test_expert_load_combined_over_cores():
    from asyncengine.engine_core.core_stats import combine

    out = combine([{"moe_expert_tokens": [1, 3], "moe_last_step_expert_tokens": [1, 0]},
                   {"moe_expert_tokens": [3, 1], "moe_last_step_expert_tokens": [0, 1]}])
    assert out["moe_expert_tokens"] == [4, 4] and out["moe_expert_imbalance"] == 1.0


async def test_expert_parallel_on_ray(ray_cluster, tiny_model_dir, tiny_reference):
    """TP=2 + EP with the ranks as Ray actors on two nodes: each holds 4 of the 8 experts, tokens as transformers'."""
    import asyncio

    from asyncengine import AsyncLLMEngine, EngineConfig

    requests, refs = tiny_reference("qwen2_moe")
    requests, refs = requests[:8], refs[:8]
    eng = AsyncLLMEngine(EngineConfig(model=tiny_model_dir("qwen2_moe"), dtype="float32", tensor_parallel_size=2,
                                      distributed_executor_backend="ray", ray_placement_strategy="STRICT_SPREAD",
                                      enable_expert_parallel=True, num_threads=1, max_num_batched_tokens=48,
                                      num_kv_blocks=64, freeze_gc_after_load=False))
    async with eng:
        assert [s["moe_local_experts"] for s in eng.core.collective_rpc("runner_stats")] == [[4, 4], [4, 4]]
        outs = await asyncio.wait_for(asyncio.gather(*(
            eng.complete({"prompt_token_ids": ids}, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for ids, n in requests)), 180)
        print(f"[moe] ray tp2+ep: {compare([o.outputs[0].token_ids for o in outs], refs)}")


def _hf_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    """transformers' own in-memory names (transformers 5: ``experts.gate_up_proj`` [E, 2I, H])."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe"])
def test_update_weights_in_place(arch, tiny_model_dir, tiny_reference):
    """Load A, update_weights with B's tensors (transformers' state_dict, then A's and B's files by
    path): the tokens equal a fresh engine on B and transformers on B; a partial update of one
    expert tensor alone applies; a wrong expert shape is refused and A keeps serving."""
    from asyncengine.errors import WeightUpdateError

    requests, refs_b = tiny_reference(arch, seed=1)
    requests, refs_b = requests[:6], refs_b[:6]
    a, b = tiny_model_dir(arch), tiny_model_dir(arch, seed=1)
    with LLM(b, dtype="float32", **REGIMES["generous"]) as llm:
        fresh_b = run(llm, requests)
    compare(fresh_b, refs_b)
    with LLM(a, dtype="float32", **REGIMES["generous"]) as llm:
        want_a = run(llm, requests)
        assert want_a != fresh_b
        sd = _hf_state_dict(b)
        bad = {k: (v[:, :-1] if ".experts." in k else v) for k, v in sd.items()}
        with pytest.raises(WeightUpdateError, match="shape"):
            llm.update_weights(bad)
        assert run(llm, requests) == want_a
        llm.update_weights(sd)
        assert run(llm, requests) == fresh_b
        llm.update_weights(a)
        assert run(llm, requests) == want_a
        llm.update_weights(b)
        assert run(llm, requests) == fresh_b


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_update_weights_on_tensor_and_expert_parallel_ranks(ep, tiny_model_dir):
    """TP=2 (each rank a column slice of every expert) or TP=2 + EP (4 whole experts each): the
    fused transformers tensors and the shared expert are cut per rank; tokens as one rank on B (Qwen2-MoE)."""
    a, b = tiny_model_dir("qwen2_moe"), tiny_model_dir("qwen2_moe", seed=1)
    requests = [([5, 6, 7, 8, 9], 6), ([11, 12], 5)]
    with LLM(b, dtype="float32", **REGIMES["generous"]) as llm:
        want_b = run(llm, requests)
    with LLM(a, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp",
             enable_expert_parallel=ep, num_threads=1, **REGIMES["generous"]) as llm:
        want_a = run(llm, requests)
        assert want_a != want_b
        llm.update_weights(_hf_state_dict(b))
        assert run(llm, requests) == want_b
        llm.update_weights(a)
        assert run(llm, requests) == want_a
