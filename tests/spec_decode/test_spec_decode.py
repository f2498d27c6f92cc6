"""Speculative decoding: multi-token steps (n-gram prompt lookup and a draft model) are greedy
token-exact with speculation off, under preemption, prefix caching, chunked prefill and the overlap
of two steps in flight; the draft model keeps its own KV (no recompute); seeded sampling is the
same with and without speculation, and follows the target distribution (chi-square)."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from asyncengine.config import EngineConfig
from asyncengine.engine_core.core import EngineCore
from asyncengine.core.request import Request
from asyncengine.errors import ConfigError
from asyncengine.sampling_params import SamplingParams
from asyncengine.spec_decode.ngram import NgramProposer
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 512


@pytest.fixture(scope="module")
def draft_dir(tiny_llama_dir, tmp_path_factory):
    """A 1-layer draft: the target's embedding and head, one perturbed copy of its first layer; it
    agrees with the target often but not always (accepted and rejected drafts)."""
    from safetensors.torch import load_file, save_file
    import json
    import os
    import shutil

    d = str(tmp_path_factory.mktemp("draft"))
    for f in os.listdir(tiny_llama_dir):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_llama_dir, f), d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["num_hidden_layers"] = 1
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    sd = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    out = {}
    for k, v in sd.items():
        if ".layers.1." in k:
            continue
        if ".layers.0." in k and v.dim() == 2:
            v = v + 0.5 * v.std() * torch.randn(v.shape, generator=g)
        out[k] = v.contiguous()
    save_file(out, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    return d


def workload(seed: int = 0, n: int = 14):
    """Prompts that repeat segments (n-gram drafts get accepted) mixed with plain random ones
    (drafts rejected), several sharing a 40-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    reqs = []
    for i in range(n):
        seg = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 9))]
        if i % 3 == 0:
            prompt = shared + seg * 2
        elif i % 3 == 1:
            prompt = seg * rng.randrange(2, 6)
        else:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 30))]
        reqs.append((prompt, rng.randrange(8, 40)))
    return reqs


def make(tiny, spec=None, **kw) -> EngineCore:
    model_dir, loaded = tiny
    return EngineCore(EngineConfig(model=model_dir, dtype="float32", speculative_config=spec, **kw), loaded)


def run(core: EngineCore, reqs, params=None, overlap: bool = False) -> dict[str, list[int]]:
    """All requests at once; ``overlap``: two steps in flight, as the async engine runs them."""
    outs = {}
    for i, (prompt, m) in enumerate(reqs):
        p = params(i, m) if params else SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        core.add_request(Request(request_id=str(i), prompt_token_ids=list(prompt), max_tokens=m, sampling_params=p))
        outs[str(i)] = []
    core.batch_queue_size = 2 if overlap else 1  # the core's own step pipeline, at that depth
    for _ in range(5000):
        batch = core.step_with_batch_queue()
        if batch is None:
            break
        for o in batch.outputs:
            outs[o.req_id] += o.new_token_ids
    assert not core.has_unfinished(), "engine did not finish"
    assert core.kv.num_free_blocks == core.num_blocks, "KV blocks leaked"
    core.kv.pool.check_invariants()
    for i, (_, m) in enumerate(reqs):
        assert len(outs[str(i)]) <= m
    return outs


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def reference(tiny):
    reqs = workload()
    return reqs, run(make(tiny), reqs)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("kv", ["roomy", "preempting"])
def test_ngram_greedy_token_exact(tiny, reference, overlap, kv):
    reqs, ref = reference
    opts = {"num_kv_blocks": 24, "block_size": 8} if kv == "preempting" else {"block_size": 8}
    core = make(tiny, NGRAM, max_num_batched_tokens=64, **opts)
    got = run(core, reqs, overlap=overlap)
    assert got == ref
    s = core.stats()
    assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"], s  # both kinds happened
    assert 0 < s["spec_acceptance_rate"] < 1 and s["spec_mean_accepted_length"] > 1
    assert s["prefix_cache_hits"] > 0
    if kv == "preempting":
        assert s["num_preemptions"] > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_draft_model_greedy_token_exact_and_no_recompute(tiny, reference, draft_dir, overlap):
    reqs, ref = reference
    k = 3
    core = make(tiny, {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k},
                max_num_batched_tokens=64, num_kv_blocks=40, block_size=8)
    got = run(core, reqs, overlap=overlap)
    assert got == ref
    s = core.stats()
    assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"], s
    assert s["prefix_cache_hits"] > 0 and s["num_preemptions"] > 0
    # the draft ran on its own KV: per step it saw what the target computed (a chunk, or the last
    # token, plus at most one more after a fully accepted row) and its own k - 1 drafts; never the
    # whole context again (which would be sum over steps of the context length)
    drafted = core.collective_rpc("runner_stats")[0]["draft_tokens_processed"]
    assert drafted <= s["num_scheduled_tokens"] + s["spec_num_drafts"]


def test_draft_model_does_not_recompute_the_context(tiny, draft_dir):
    """After the prefill, each step the draft runs on at most k + 1 positions (the catch-up and its
    own drafts), however long the context."""
    k = 3
    core = make(tiny, {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k})
    rng = random.Random(2)
    prompt = [rng.randrange(3, VOCAB) for _ in range(300)]
    core.add_request(Request(request_id="long", prompt_token_ids=prompt, max_tokens=40,
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)))
    seen, deltas, n_out = 0, [], 0
    while core.has_unfinished():
        n_out += sum(len(o.new_token_ids) for o in core.step())
        now = core.collective_rpc("runner_stats")[0]["draft_tokens_processed"]
        deltas.append(now - seen)
        seen = now
    assert n_out == 40 and deltas[0] == 300
    assert len(deltas) > 5 and max(deltas[1:]) <= k + 1, deltas


def test_draft_equal_to_target_accepts_everything(tiny, tiny_llama_dir):
    reqs = workload(seed=3, n=5)
    ref = run(make(tiny), reqs)
    core = make(tiny, {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 4})
    assert run(core, reqs, overlap=True) == ref
    s = core.stats()
    assert s["spec_acceptance_rate"] == 1.0 and s["spec_mean_accepted_length"] > 3


def test_seeded_sampling_same_with_and_without_speculation(tiny, reference):
    """Point-mass drafts + 'accept iff the target's own seeded draw equals it' = exactly the
    tokens of the non-speculative run, processors (penalties, min_tokens) included."""
    reqs, _ = reference

    def params(i, m):
        return SamplingParams(temperature=0.2 if i % 3 else 0.7, top_p=0.95 if i % 2 else 1.0, seed=1000 + i, max_tokens=m,
                              repetition_penalty=1.1 if i % 4 == 1 else 1.0, min_tokens=3, logprobs=2 if i % 5 == 0 else None)

    ref = run(make(tiny), reqs, params)
    core = make(tiny, NGRAM, max_num_batched_tokens=64, block_size=8)
    assert run(core, reqs, params, overlap=True) == ref
    assert core.stats()["spec_num_accepted_tokens"] > 0


def test_logprobs_of_accepted_tokens(tiny):
    """Every accepted token comes with its own logprobs entry (sampled id first)."""
    rng = random.Random(5)
    seg = [rng.randrange(3, VOCAB) for _ in range(5)]
    core = make(tiny, NGRAM)
    core.add_request(Request(request_id="a", prompt_token_ids=seg * 5, max_tokens=30,
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, ignore_eos=True)))
    toks, lps = [], []
    while core.has_unfinished():
        for o in core.step():
            toks += o.new_token_ids
            lps += o.new_logprobs or []
            assert len(o.new_logprobs or []) == len(o.new_token_ids)
    assert len(toks) == 30 and [e[0][0] for e in lps] == toks
    assert core.stats()["spec_num_accepted_tokens"] > 0


def test_stop_inside_accepted_drafts(tiny, reference):
    """A stop token among the accepted drafts ends the request there; nothing after it leaks."""
    reqs, ref = reference
    i, out = next((i, o) for i, o in ref.items() if len(o) > 6 and len(set(o)) > 3)
    stop = out[4]
    first = out.index(stop)
    core = make(tiny, NGRAM)
    prompt, m = reqs[int(i)]
    core.add_request(Request(request_id="s", prompt_token_ids=list(prompt), max_tokens=m,
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=m, stop_token_ids=[stop])))
    toks, reason = [], None
    while core.has_unfinished():
        for o in core.step():
            toks += o.new_token_ids
            reason = o.finish_reason or reason
    assert toks == out[:first + 1] and reason == "stop"


def test_ngram_proposer():
    p = NgramProposer(1, 3, 3)
    assert p.propose([1, 2, 3, 4, 1, 2]) == [3, 4, 1]  # longest suffix [1, 2] -> what followed
    assert p.propose([5, 6, 7]) == []
    assert p.propose([1, 2, 9, 1, 2, 8, 1, 2]) == [8, 1, 2]  # latest occurrence wins
    assert p.propose([7, 7]) == [7]


def test_speculative_config_errors():
    with pytest.raises(ConfigError, match="unknown field"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative": 3})
    with pytest.raises(ConfigError, match="needs 'model'"):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    assert EngineConfig(speculative_config={"model": "x"}).speculative.method == "draft_model"


# ------------------------------------------------------------------ distribution (chi-square)


@pytest.fixture(scope="module")
def tiny_vocab_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny-vocab8"))
    make_tiny_checkpoint(d, "llama", vocab_size=8, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return d


def test_chi_square_speculative_sampling_follows_target(tiny_vocab_dir):
    """Tiny vocabulary (8): 1500 seeded samples of a 4-token continuation with n-gram speculation
    (drafts accepted and rejected). The token at output position 2 (a verified draft row: t0 comes
    from the prefill, t1 is a spec row's first sample), given the most frequent (t0, t1), must
    follow the target's softmax for that context."""
    from scipy.stats import chisquare

    from asyncengine.models.loader import load_model

    cfg = EngineConfig(model=tiny_vocab_dir, dtype="float32", skip_tokenizer_init=True)
    loaded = load_model(cfg)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    n = 1500
    core = EngineCore(EngineConfig(model=tiny_vocab_dir, dtype="float32", skip_tokenizer_init=True,
                                   max_num_seqs=256, speculative_config=NGRAM), loaded)
    outs = run(core, [(prompt, 4)] * n,
               params=lambda i, m: SamplingParams(temperature=1.0, seed=i, max_tokens=m, ignore_eos=True))
    s = core.stats()
    assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]
    ctx, _ = Counter(tuple(o[:2]) for o in outs.values()).most_common(1)[0]
    seen = Counter(o[2] for o in outs.values() if tuple(o[:2]) == ctx)
    total = sum(seen.values())
    assert total >= 100
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_vocab_dir, dtype=torch.float32)
    with torch.no_grad():
        probs = hf(torch.tensor([prompt + list(ctx)])).logits[0, -1].double().softmax(-1)
    exp = probs / probs.sum() * total
    keep = exp >= 5  # chi-square needs expected counts >= 5: pool the rest
    obs = torch.tensor([seen.get(t, 0) for t in range(8)], dtype=torch.float64)
    f_obs = list(obs[keep].tolist()) + [float(obs[~keep].sum())]
    f_exp = list(exp[keep].double().tolist()) + [float(exp[~keep].sum())]
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    assert len(f_exp) >= 2
    p = chisquare(f_obs, f_exp).pvalue
    assert p > 0.001, (seen, probs.tolist(), p)


# ------------------------------------------------------------------ the async engine, end to end


def test_async_engine_with_speculation(tiny_llama_dir):
    """Through AsyncLLMEngine (two steps in flight): greedy streams match speculation off; n = 2
    seeded samples, logprobs, a stop string and priorities work; an abort mid-stream leaves nothing
    behind; the spec counters reach /metrics' collector."""
    import asyncio

    from asyncengine import AsyncLLMEngine
    from asyncengine.integrations.openai_server.metrics import EngineCollector

    rng = random.Random(9)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 7))] * 4 for _ in range(6)]

    async def go(spec):
        eng = AsyncLLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8,
                                          policy="priority", speculative_config=spec))
        try:
            greedy = [eng.complete(p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1),
                                   request_id=f"g{i}", priority=i % 2) for i, p in enumerate(prompts)]
            sampled = eng.complete(prompts[0], SamplingParams(n=2, temperature=0.5, seed=7, max_tokens=16,
                                                              ignore_eos=True), request_id="n2")
            text_ref = eng.complete(prompts[1], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                                    request_id="t")
            outs = await asyncio.wait_for(asyncio.gather(*greedy, sampled, text_ref), 120)
            # a stop string cut: the same prompt, stopping at a piece of the text the greedy run made
            full = outs[-1].outputs[0].text
            stop = full[len(full) // 2:len(full) // 2 + 3]
            cut = await asyncio.wait_for(eng.complete(prompts[1], SamplingParams(
                temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]), request_id="stop"), 60) if stop.strip() else None
            # an abort mid-stream
            stream = eng.generate(prompts[2], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
                                  request_id="ab")
            async for o in stream:
                if len(o.outputs[0].token_ids) >= 5:
                    await eng.abort("ab")
                    break
            for _ in range(500):
                if eng.stats()["num_running"] == 0 and eng.stats()["num_waiting"] == 0:
                    break
                await asyncio.sleep(0.01)
            stats = eng.stats()
            metrics = {f.name: f.samples[0].value for f in EngineCollector(eng).collect() if f.samples}
            assert eng.core.kv.num_free_blocks == eng.core.num_blocks
            return outs, cut, stats, metrics
        finally:
            await eng.shutdown()

    ref, ref_cut, _, _ = asyncio.run(go(None))
    got, cut, stats, metrics = asyncio.run(go(NGRAM))
    for a, b in zip(ref, got):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
    for a, b in zip(ref[:len(prompts)], got[:len(prompts)]):
        lp_a, lp_b = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(lp_b) == len(b.outputs[0].token_ids)
        for x, y in zip(lp_a, lp_b):
            assert x.keys() == y.keys()
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) < 1e-4
    if ref_cut is not None:
        assert cut.outputs[0].text == ref_cut.outputs[0].text and cut.outputs[0].finish_reason == "stop"
    assert stats["spec_num_accepted_tokens"] > 0
    assert metrics["asyncengine_spec_decode_num_accepted_tokens"] == stats["spec_num_accepted_tokens"]
    assert 0 < metrics["asyncengine_spec_decode_acceptance_rate"] <= 1
    assert metrics["asyncengine_spec_decode_mean_accepted_length"] > 1
