"""Token parity with transformers: greedy, fp32, EOS ignored, one reference ``generate()`` per request.

Every architecture runs the same 18-request workload (prompts 3-60 tokens, outputs 1-24 tokens)
under three cache regimes that exercise different scheduler paths: (a) a generous cache (plain
continuous batching), (b) a 16-token step budget (chunked prefill, decodes mixed with prefill
chunks), (c) a 24-block pool (preemption by recompute), all on the cpu attention backend (the C
kernels), and (b) on the torch backend too. Outputs must equal the reference token for
token, except that a first divergence is excused where the reference's top-2 logit gap is below
1e-4 (``model_utils.compare``); the number of such excuses is printed (``pytest -s``) and summarised
at the end of the module.

Checkpoint variants: sharded safetensors with an index, tied embeddings, a bf16 checkpoint, and
Llama-3 rope scaling (tied and rope on the 8 longest requests of the workload). Prefix caching on
and off must give the same tokens.

Every engine run ends with the pool whole again: ``engine.kv.num_free_blocks == engine.num_blocks``.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from asyncengine import LLM, SamplingParams
from model_utils import compare

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# engine options of the three regimes (what each must have exercised is asserted in test_parity)
REGIMES = {
    "generous": dict(num_kv_blocks=256, block_size=16),
    "chunked": dict(num_kv_blocks=256, block_size=8, max_num_batched_tokens=16),
    "preempt": dict(num_kv_blocks=24, block_size=4),  # 96 token slots: the longest request is 84
}

NEAR_TIES: dict[str, dict] = {}  # test label -> compare() counts, printed at module teardown


@pytest.fixture(scope="module", autouse=True)
def _near_tie_summary():
    yield
    if NEAR_TIES:
        total = sum(c["total"] for c in NEAR_TIES.values())
        excused = sum(c["near_tie"] for c in NEAR_TIES.values())
        print(f"\n[parity] near-tie excuses: {excused} of {total} requests over {len(NEAR_TIES)} runs")
        for label, c in NEAR_TIES.items():
            if c["near_tie"]:
                print(f"[parity]   {label}: {c}")


def record(label: str, counts: dict) -> dict:
    NEAR_TIES[label] = counts
    print(f"[parity] {label}: exact {counts['exact']}, near-tie {counts['near_tie']} of {counts['total']}")
    return counts


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class StepLog:
    """Wraps ``engine.schedule`` to keep every SchedulerOutput (and the prompt lengths of new requests)."""

    def __init__(self, engine) -> None:
        self.steps = []
        self.engine = engine
        inner = engine.schedule

        def schedule():
            so = inner()
            self.steps.append(so)
            return so

        engine.schedule = schedule

    def chunked_prompts(self) -> list[str]:
        """Requests admitted with fewer tokens than their prompt still needed (a prefill split in chunks)."""
        out = []
        for so in self.steps:
            for nr in so.new_requests:
                todo = len(nr.prompt_token_ids) + len(nr.output_token_ids) - nr.num_computed_tokens
                if so.num_scheduled_tokens[nr.req_id] < todo:
                    out.append(nr.req_id)
        return out

    def mixed_steps(self) -> int:
        """Steps that ran at least one single-token decode together with a multi-token prefill chunk."""
        n = 0
        for so in self.steps:
            sizes = list(so.num_scheduled_tokens.values())
            if 1 in sizes and any(s > 1 for s in sizes):
                n += 1
        return n


def run(llm: LLM, requests) -> list[list[int]]:
    """Generate for every (prompt ids, max_tokens); check lengths and that no KV block leaked."""
    outs = llm.generate([list(p) for p, _ in requests], [greedy(m) for _, m in requests], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [list(p) for p, _ in requests]
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "length"
    check_no_leak(llm)
    return [o.outputs[0].token_ids for o in outs]


def check_no_leak(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished()
    assert eng.kv.num_free_blocks == eng.num_blocks, "KV blocks leaked"
    assert not eng.kv.req_to_blocks
    eng.kv.pool.check_invariants()


# ---------------------------------------------------------------------------- the four architectures


# every regime on the cpu attention backend (C kernels: the CPU default); the torch backend on the
# regime that mixes decodes with prefill chunks
BACKEND_REGIMES = [("cpu", r) for r in REGIMES] + [("torch", "chunked")]


@pytest.mark.parametrize("backend,regime", BACKEND_REGIMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_parity(arch, backend, regime, tiny_model_dir, tiny_reference):
    requests, refs = tiny_reference(arch)
    assert len(requests) >= 16
    opts = REGIMES[regime]
    llm = LLM(tiny_model_dir(arch), dtype="float32", attention_backend=backend, **opts)
    assert llm.config.attention_backend_name == backend
    log = StepLog(llm.engine)
    counts = record(f"{arch}/{backend}/{regime}", compare(run(llm, requests), refs))
    assert counts["exact"] + counts["near_tie"] == len(requests)

    stats = llm.engine.stats()
    budget = llm.config.max_num_batched_tokens
    assert all(so.total_num_scheduled_tokens <= budget for so in log.steps)
    if regime == "generous":
        assert stats["num_preemptions"] == 0
    elif regime == "chunked":
        assert max(len(p) for p, _ in requests) > budget
        assert log.chunked_prompts(), "no prompt was split across steps"
        assert log.mixed_steps() > 0, "no step mixed decodes with a prefill chunk"
    elif regime == "preempt":
        assert stats["num_preemptions"] > 0
        assert any(so.num_preempted for so in log.steps)


# ---------------------------------------------------------------------------- checkpoint variants


def test_sharded_checkpoint(tiny_llama_dir, tiny_reference, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    index = tmp_path / "model.safetensors.index.json"
    assert index.exists() and not (tmp_path / "model.safetensors").exists()
    shards = set(json.loads(index.read_text())["weight_map"].values())
    assert len(shards) >= 3 and all((tmp_path / s).exists() for s in shards)

    requests, refs = tiny_reference("llama")
    llm = LLM(str(tmp_path), dtype="float32", **REGIMES["generous"])
    record("llama/sharded", compare(run(llm, requests), refs))


def variant_workload(tiny_reference, hf_reference, model_dir: str, n: int = 8):
    """For checkpoint variants: the ``n`` longest requests of the llama workload, with references
    from ``model_dir`` (less than half the transformers time of the full workload)."""
    requests, _ = tiny_reference("llama")
    subset = sorted(requests, key=lambda r: len(r[0]) + r[1], reverse=True)[:n]
    return subset, hf_reference(model_dir, subset)


def test_tied_embeddings(tiny_model_dir, tiny_reference, hf_reference):
    d = tiny_model_dir("llama", tie_word_embeddings=True)
    with safe_open(str(Path(d) / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names  # truly tied on disk: the head must come from the embedding
    requests, refs = variant_workload(tiny_reference, hf_reference, d)
    llm = LLM(d, dtype="float32", **REGIMES["chunked"])
    from worker_hooks import model_facts
    assert llm.engine.collective_rpc(model_facts)[0]["lm_head_is_none"]
    record("llama/tied", compare(run(llm, requests), refs))


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_llama3_rope_scaling(tiny_model_dir, tiny_reference, hf_reference):
    d = tiny_model_dir("llama", rope_parameters=dict(LLAMA3_ROPE))
    llm = LLM(d, dtype="float32", **REGIMES["chunked"])

    # the inverse frequencies are transformers' own (all three bands: kept, blended, scaled)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from asyncengine.layers.rotary import compute_inv_freq
    from worker_hooks import model_facts
    assert llm.engine.collective_rpc(model_facts)[0]["rope_type"] == "llama3"
    cfg = transformers.AutoConfig.from_pretrained(d)
    from asyncengine.layers.rotary import rope_parameters
    params = rope_parameters(cfg)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ours = compute_inv_freq(head_dim, params)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.AutoConfig.from_pretrained(d), "cpu")
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    plain = compute_inv_freq(head_dim, {"rope_type": "default", "rope_theta": 10000.0})
    assert ours[0] == plain[0] and (ours[-1] - plain[-1] / 8).abs() < 1e-12 and not torch.equal(ours, plain)

    requests, refs = variant_workload(tiny_reference, hf_reference, d)
    record("llama/llama3-rope", compare(run(llm, requests), refs))


def test_bf16_checkpoint(tiny_llama_dir, tiny_reference, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert all(f.get_slice(n).get_dtype() == "BF16" for n in f.keys())

    requests, refs = tiny_reference("llama")  # fp32 weights: bf16 is only expected to agree mostly
    llm = LLM(str(tmp_path), dtype="bfloat16", **REGIMES["chunked"])
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
    from worker_hooks import model_facts
    assert llm.engine.collective_rpc(model_facts)[0]["param_dtypes"] == ["torch.bfloat16"]
    outs = run(llm, requests)
    first_ok = sum(o[0] == r.tokens[0] for o, r in zip(outs, refs))
    agree = sum(next((k for k, (a, b) in enumerate(zip(o, r.tokens)) if a != b), len(o)) for o, r in zip(outs, refs))
    total = sum(len(r.tokens) for r in refs)
    print(f"[parity] llama/bf16: first token agrees in {first_ok}/{len(refs)} requests, "
          f"{agree}/{total} tokens before the first divergence")
    assert first_ok >= 0.75 * len(refs)
    assert agree >= 0.5 * total


# ---------------------------------------------------------------------------- prefix caching


def test_prefix_caching_on_off_identical(tiny_llama_dir, hf_reference):
    rng = random.Random(7)
    prefix = [rng.randrange(3, 512) for _ in range(37)]  # 4.6 blocks of 8: hits end mid-prefix
    requests = [(prefix + [rng.randrange(3, 512) for _ in range(rng.randint(1, 20))], rng.randint(2, 16))
                for _ in range(10)]
    requests.append((list(prefix), 5))  # the bare prefix: its last token must still be computed
    refs = hf_reference(tiny_llama_dir, requests)

    results = {}
    for caching in (True, False):
        llm = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=128, block_size=8,
                  max_num_batched_tokens=64, enable_prefix_caching=caching)
        first = run(llm, requests)
        second = run(llm, requests[::-1])[::-1]  # again, now from blocks freed but still cached
        assert first == second
        stats = llm.engine.stats()
        if caching:
            assert stats["prefix_cache_hits"] >= 11 * 32  # second round alone: every request hits 4 blocks
        else:
            assert stats["prefix_cache_hits"] == 0
        results[caching] = first
        record(f"llama/prefix-caching-{'on' if caching else 'off'}", compare(first, refs))
    assert results[True] == results[False]
