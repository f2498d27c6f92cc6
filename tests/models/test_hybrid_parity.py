"""Hybrid models (Mamba2 state-space layers, with or without attention) against transformers' own
CPU path: greedy, fp32, EOS ignored, token-exact except a first divergence at a reference near-tie
(``model_utils.compare``).

All four architectures (pure Mamba2, Bamba, NemotronH, GraniteMoeHybrid, tiny random checkpoints
from ``model_utils.HYBRID_ARCHS``) run the standard 18-request workload in three regimes: a
generous cache (mixed batches of prefills and decodes), a 16-token step budget (chunked prefill:
the Mamba state is carried from chunk to chunk) and a 24-block pool (preemption: the state slot is
freed and the request recomputed). Then the request life cycle around the state slot: ``n > 1``,
abort in the middle of a prefill, prefix caching asked for (off for hybrids, with a log line),
what is refused (speculative decoding, tensor parallelism, a NemotronH MoE latent projection), and the async engine's
streams against the offline outputs. After every run no KV block and no state slot is held.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil

import pytest
import torch

from asyncengine import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from asyncengine.errors import ConfigError, ModelLoadError
from model_utils import compare

HYBRIDS = ("mamba2", "bamba", "nemotron_h", "granitemoehybrid")

REGIMES = {
    "generous": dict(num_kv_blocks=256, block_size=16),
    "chunked": dict(num_kv_blocks=256, block_size=8, max_num_batched_tokens=16),
    "preempt": dict(num_kv_blocks=24, block_size=4),  # 96 token slots: the longest request is 84
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


class StepLog:
    """Keeps every SchedulerOutput the engine builds."""

    def __init__(self, engine) -> None:
        self.steps = []
        inner = engine.schedule

        def schedule():
            so = inner()
            self.steps.append(so)
            return so

        engine.schedule = schedule

    def split_prefills(self) -> int:
        """New requests admitted with fewer tokens than their prompt still needed."""
        return sum(1 for so in self.steps for nr in so.new_requests
                   if so.num_scheduled_tokens[nr.req_id] < len(nr.prompt_token_ids) - nr.num_computed_tokens)

    def mixed_steps(self) -> int:
        return sum(1 for so in self.steps
                   if 1 in so.num_scheduled_tokens.values() and any(n > 1 for n in so.num_scheduled_tokens.values()))


def check_nothing_held(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished()
    assert eng.kv.num_free_blocks == eng.num_blocks, "KV blocks leaked"
    assert eng.kv.slots.num_free == eng.kv.slots.num_slots, "state slots leaked"
    assert not eng.kv.req_to_blocks
    eng.kv.pool.check_invariants()


def run(llm: LLM, requests) -> list[list[int]]:
    outs = llm.generate([list(p) for p, _ in requests], [greedy(m) for _, m in requests], use_tqdm=False)
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "length"
    check_nothing_held(llm)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("arch", HYBRIDS)
def test_parity(arch, regime, tiny_model_dir, tiny_reference):
    requests, refs = tiny_reference(arch)
    llm = LLM(tiny_model_dir(arch), dtype="float32", **REGIMES[regime])
    log = StepLog(llm.engine)
    counts = compare(run(llm, requests), refs)
    print(f"[hybrid parity] {arch}/{regime}: {counts}")
    stats = llm.engine.stats()
    if regime == "generous":
        assert stats["num_preemptions"] == 0
        assert max(len(so.new_requests) for so in log.steps) > 1, "no step batched several prompts"
    elif regime == "chunked":
        assert log.split_prefills() > 0, "no prompt was split across steps"
        assert log.mixed_steps() > 0
    else:
        assert stats["num_preemptions"] > 0


def logprob_run(model_dir: str, requests, **regime) -> tuple[list, StepLog]:
    """Each request's greedy tokens, their logprobs and its prompt's logprobs."""
    llm = LLM(model_dir, dtype="float32", **regime)
    log = StepLog(llm.engine)
    try:
        outs = llm.generate([list(p) for p, _ in requests], [greedy(m, logprobs=0, prompt_logprobs=0)
                                                              for _, m in requests], use_tqdm=False)
        check_nothing_held(llm)
    finally:
        llm.shutdown()
    got = []
    for o in outs:
        c = o.outputs[0]
        got.append((c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                    [lp[t].logprob for t, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]))
    return got, log


@pytest.mark.parametrize("arch", HYBRIDS)
def test_chunks_carry_the_state_logprobs_match_unchunked(arch, tiny_model_dir, tiny_reference):
    """Greedy tokens of the tiny random hybrids barely depend on the SSM state a prefill chunk
    inherits (a state dropped at every chunk boundary still gives transformers' tokens), so the
    chunked parity test alone cannot show the state is carried; logprobs do: chunks of 16 tokens
    give the unchunked run's logprobs to 1e-4 (measured: <= 1.5e-6; with the state dropped the
    prompts' logprobs move by 6e-3 to 0.8, the outputs' by 1.4e-3 to 0.09)."""
    requests, _ = tiny_reference(arch)
    whole, _ = logprob_run(tiny_model_dir(arch), requests, **REGIMES["generous"])
    chunked, log = logprob_run(tiny_model_dir(arch), requests, **REGIMES["chunked"])
    assert log.split_prefills() > 0, "no prompt was split across steps"
    for i, ((toks_w, out_w, prompt_w), (toks_c, out_c, prompt_c)) in enumerate(zip(whole, chunked)):
        n = next((k for k, (a, b) in enumerate(zip(toks_w, toks_c)) if a != b), len(toks_w))
        assert n > 0, f"request {i}: the first token differs"
        assert prompt_c == pytest.approx(prompt_w, abs=1e-4), f"request {i}: prompt logprobs"
        assert out_c[:n] == pytest.approx(out_w[:n], abs=1e-4), f"request {i}: output logprobs"


def test_torch_attention_backend(tiny_model_dir, tiny_reference):
    """The attention layers through the plain torch backend, in the chunked regime."""
    requests, refs = tiny_reference("bamba")
    llm = LLM(tiny_model_dir("bamba"), dtype="float32", attention_backend="torch", **REGIMES["chunked"])
    compare(run(llm, requests), refs)


# ---------------------------------------------------------------------------- the state slot's life cycle


@pytest.mark.parametrize("arch", ("mamba2", "bamba"))
def test_n_samples_each_follow_their_own_state(arch, tiny_model_dir, tiny_reference):
    """``n = 3`` greedy samples of each prompt all equal the reference (each sample has its own slot,
    none sees another's state), and seeded random samples equal the same seeds asked one at a time."""
    requests, refs = tiny_reference(arch)
    subset = list(zip(requests, refs))[:6]
    llm = LLM(tiny_model_dir(arch), dtype="float32", max_num_seqs=4, **REGIMES["chunked"])
    outs = llm.generate([list(p) for (p, _), _ in subset], [greedy(m, n=3) for (_, m), _ in subset], use_tqdm=False)
    for o, (_, ref) in zip(outs, subset):
        assert len(o.outputs) == 3
        compare([s.token_ids for s in o.outputs], [ref] * 3)
    prompt = list(subset[0][0][0])
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=2, seed=7)
    together = [s.token_ids for s in llm.generate([prompt], [sampled], use_tqdm=False)[0].outputs]
    apart = [llm.generate([prompt], [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=s)],
                          use_tqdm=False)[0].outputs[0].token_ids for s in (7, 8)]
    assert together == apart
    check_nothing_held(llm)


@pytest.mark.parametrize("arch", ("mamba2", "granitemoehybrid"))
def test_n_samples_fork_sample_zeros_state(arch, tiny_model_dir, tiny_reference):
    """The prompt is computed once: samples 1..n-1 copy sample 0's state at its last block boundary
    before the final prompt token, share its blocks up to there and compute only the tail. With no
    free slot at the fork a sample computes its whole prompt itself; both are exact."""
    requests, refs = tiny_reference(arch)
    (prompt, max_tokens), ref = max(zip(requests, refs), key=lambda r: len(r[0][0]))
    bs = 4
    fork = (len(prompt) - 1) // bs * bs
    for seqs, forked in ((4, True), (1, False)):
        llm = LLM(tiny_model_dir(arch), dtype="float32", max_num_seqs=seqs, num_kv_blocks=128, block_size=bs)
        log = StepLog(llm.engine)
        out = llm.generate([prompt], [greedy(max_tokens, n=3)], use_tqdm=False)[0]
        compare([s.token_ids for s in out.outputs], [ref] * 3)
        copies = [c for so in log.steps for c in so.state_copies]
        computed = llm.engine.stats()["num_computed_prompt_tokens"]
        if forked:
            assert len(copies) == 2
            assert computed == len(prompt) + 2 * (len(prompt) - fork)
        else:
            assert copies == [] and computed == 3 * len(prompt)
        check_nothing_held(llm)


def test_abort_after_the_fork_frees_shared_blocks_and_slots(tiny_model_dir, tiny_reference):
    """Aborting an n = 3 request once its samples have forked (they hold references on sample 0's
    blocks and their own slots) gives every block and slot back."""
    from asyncengine.core.request import Request

    requests, _ = tiny_reference("bamba")
    prompt = max((p for p, _ in requests), key=len)
    llm = LLM(tiny_model_dir("bamba"), dtype="float32", max_num_seqs=3, num_kv_blocks=128, block_size=4,
              max_num_batched_tokens=8)
    core = llm.engine
    core.add_request(Request("n3", list(prompt), greedy(4, n=3), eos_token_ids=set(), max_tokens=4))
    forked = False
    for _ in range(len(prompt)):
        core.step()
        kids = [r for rid, r in core.scheduler.requests.items() if rid != "n3#0"]
        if kids and all(r.num_computed_tokens > 0 for r in kids):
            forked = True
            break
    assert forked, "the samples never forked"
    assert core.kv.slots.num_free == 0
    assert sorted(core.abort_requests(["n3"])) == ["n3#0", "n3#1", "n3#2"]
    core.step()
    check_nothing_held(llm)


@pytest.mark.parametrize("arch", ("mamba2", "nemotron_h"))
def test_abort_mid_prefill_frees_slot_and_blocks(arch, tiny_model_dir, tiny_reference):
    """A request aborted after some of its prompt chunks gives back its blocks and its slot, and the
    next request to get that slot starts from a clean state (its output is the reference's)."""
    from asyncengine.core.request import Request

    requests, refs = tiny_reference(arch)
    (prompt, max_tokens), ref = max(zip(requests, refs), key=lambda r: len(r[0][0]))
    llm = LLM(tiny_model_dir(arch), dtype="float32", max_num_seqs=1, num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=8)
    core = llm.engine
    core.add_request(Request("doomed", list(reversed(prompt)), greedy(5), eos_token_ids=set(), max_tokens=5))
    core.step()
    core.step()
    doomed = core.scheduler.requests["doomed"]
    assert 0 < doomed.num_computed_tokens < len(prompt), "not in the middle of its prefill"
    assert core.kv.slots.num_free == 0
    assert core.abort_requests(["doomed"]) == ["doomed"]
    assert core.kv.slots.num_free == 1 and core.kv.num_free_blocks == core.num_blocks
    out = llm.generate([prompt], [greedy(max_tokens)], use_tqdm=False)[0].outputs[0].token_ids
    compare([out], [ref])
    check_nothing_held(llm)
    assert "doomed" not in core.collective_rpc("runner_stats")[0]["request_ids"]


def test_prefix_caching_is_off_for_hybrids_with_a_log_line(tiny_model_dir, tiny_reference, caplog):
    requests, refs = tiny_reference("granitemoehybrid")
    shared = [(requests[0][0] + p, m) for p, m in requests[1:6]]  # a common beginning
    outs = {}
    for on in (True, False):
        with caplog.at_level(logging.INFO, logger="asyncengine.core.hybrid_kv_cache_manager"):
            caplog.clear()
            llm = LLM(tiny_model_dir("granitemoehybrid"), dtype="float32", enable_prefix_caching=on,
                      **REGIMES["generous"])
        said = any("prefix caching is off" in r.getMessage() for r in caplog.records)
        assert said == on
        outs[on] = run(llm, shared)
        assert llm.engine.stats()["prefix_cache_hits"] == 0
    assert outs[True] == outs[False]


# ---------------------------------------------------------------------------- what is refused


def test_speculative_decoding_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match="speculative decoding is not supported for BambaForCausalLM"):
        LLM(tiny_model_dir("bamba"), dtype="float32",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_tensor_parallel_is_refused_before_workers_start(tiny_model_dir):
    from asyncengine.engine_core.core import EngineCore

    with pytest.raises(ConfigError, match="tensor_parallel_size > 1"):
        EngineCore(EngineConfig(model=tiny_model_dir("nemotron_h"), dtype="float32", tensor_parallel_size=2))


def test_moe_latent_projection_is_refused_clearly():
    """NemotronH's MoE layers are built (tests/models/test_moe.py), but not with a latent projection."""
    import transformers

    from asyncengine.models.nemotron_h import NemotronHForCausalLM

    nemotron = transformers.NemotronHConfig(hidden_size=64, hybrid_override_pattern="M*E", num_attention_heads=4,
                                            head_dim=16, mamba_num_heads=8, mamba_head_dim=16, moe_latent_size=32)
    with torch.device("meta"):
        with pytest.raises(ModelLoadError, match="latent"):
            NemotronHForCausalLM(nemotron, 64)


def test_metrics_show_the_state_cache(tiny_model_dir):
    llm = LLM(tiny_model_dir("bamba"), dtype="float32", max_num_seqs=3, num_kv_blocks=32)
    s = llm.engine.stats()
    assert s["num_state_slots"] == 3 and s["num_free_state_slots"] == 3
    per_slot = llm.engine.collective_rpc("runner_stats")[0]
    assert s["state_cache_bytes"] > 0
    assert per_slot["num_kv_blocks"] == 32


# ---------------------------------------------------------------------------- async engine


async def test_async_streams_equal_offline(tiny_model_dir, tiny_reference):
    requests, refs = tiny_reference("bamba")
    opts = dict(dtype="float32", **REGIMES["chunked"])
    offline = run(LLM(tiny_model_dir("bamba"), **opts), requests)
    compare(offline, refs)

    async def stream(eng, i, prompt, max_tokens):
        toks = []
        async for out in eng.generate({"prompt_token_ids": list(prompt)}, greedy(max_tokens), request_id=f"r{i}"):
            toks.extend(out.token_ids_delta)
        return toks

    async with AsyncLLMEngine(EngineConfig(model=tiny_model_dir("bamba"), **opts)) as eng:
        got = await asyncio.wait_for(asyncio.gather(*(stream(eng, i, p, m) for i, (p, m) in enumerate(requests))), 300)
    assert got == offline


# ---------------------------------------------------------------------------- bfloat16


def state_dtypes(worker) -> list[tuple[str, str]]:
    return [(str(conv.dtype), str(ssm.dtype)) for conv, ssm in worker.runner.state_cache.states]


def test_bfloat16_keeps_the_ssm_state_in_float32(tiny_model_dir, tiny_reference):
    """In bfloat16 the conv windows follow the model's dtype and the SSM state stays fp32 (it sums
    the whole sequence); greedy tokens then mostly agree with the fp32 reference (a guard against
    gross breakage, not a parity claim: bf16 rounds every matmul)."""
    requests, refs = tiny_reference("nemotron_h")
    llm = LLM(tiny_model_dir("nemotron_h"), dtype="bfloat16", **REGIMES["chunked"])
    assert set(llm.engine.collective_rpc(state_dtypes)[0]) == {("torch.bfloat16", "torch.float32")}
    outs = run(llm, requests)
    first_agree = sum(o[0] == r.tokens[0] for o, r in zip(outs, refs))
    assert first_agree >= 0.8 * len(requests), f"{first_agree} of {len(requests)} first tokens agree"


def linear_qtypes(worker) -> list[str]:
    from asyncengine.layers.linear import Linear

    return sorted({str(m.qtype) for m in worker.model.modules() if isinstance(m, Linear)})


def q8_0_round_trip(src: str, dst: str) -> str:
    """A copy of checkpoint ``src`` whose matrices hold what Q8_0 keeps of them (each row's blocks
    of 32 quantized and dequantized, as the engine does per row): transformers on it is the
    reference for an int8 engine with fp32 activations."""
    from safetensors.torch import load_file, save_file

    from asyncengine.kernels.cpu import quant

    shutil.copytree(src, dst)
    for f in os.listdir(dst):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(dst, f))
            for name, t in tensors.items():
                if t.dim() == 2 and t.shape[1] % 32 == 0:
                    tensors[name] = quant.dequantize_torch(quant.quantize(t, "Q8_0"), "Q8_0", t.shape[1]).to(t.dtype)
            save_file(tensors, os.path.join(dst, f), metadata={"format": "pt"})
    return dst


def test_int8_quantizes_every_projection(tiny_model_dir, tiny_reference, hf_reference, tmp_path):
    """``quantization="int8"``: the Mamba in/out projections, attention, MLP, embedding and head all
    run from Q8_0 blocks (the conv, A, D and norms stay dense). With fp32 activations they give
    transformers' tokens on the same Q8_0-rounded weights (near-ties excused); with the default
    (int8 activations, which round x too) the requests complete."""
    requests, _ = tiny_reference("bamba")
    refs = hf_reference(q8_0_round_trip(tiny_model_dir("bamba"), str(tmp_path / "q8")), requests[:6])
    for activations in ("fp32", "auto"):
        llm = LLM(tiny_model_dir("bamba"), dtype="float32", quantization="int8", quantized_activations=activations,
                  **REGIMES["chunked"])
        try:
            assert llm.engine.collective_rpc(linear_qtypes)[0] == ["Q8_0"]
            got = run(llm, requests[:6])
        finally:
            llm.shutdown()
        if activations == "fp32":
            counts = compare(got, refs)
            assert counts["exact"] + counts["near_tie"] == counts["total"]
