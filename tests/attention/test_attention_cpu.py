"""The CPU paged-attention backend against dense per-request attention.

Requests' blocks sit shuffled in the cache; group and query-block sizes are shrunk so that one
step exercises several decode groups (with padding and masking), several query blocks of a prefill
chunk, and a chunk after cached context.
"""
from __future__ import annotations

import random

import pytest
import torch

import asyncengine.layers.attention as A

HQ, HK, D, BS = 8, 2, 16, 4


def dense(q, k, v, context_len):
    """q: [n, Hq, D] at positions context_len.., k/v: [context_len + n, Hk, D]; causal, fp64."""
    total = k.shape[0]
    g = HQ // HK
    qd, kd, vd = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = torch.einsum("qhd,khd->hqk", qd, kd) * D ** -0.5
    allowed = torch.arange(total)[None, :] <= torch.arange(context_len, total)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_matches_dense(monkeypatch, dtype):
    monkeypatch.setattr(A, "DECODE_GROUP_TOKENS", 64)  # several groups at these lengths
    monkeypatch.setattr(A, "PREFILL_QUERY_BLOCK", 8)  # several query blocks per chunk
    A._TRIANGLES.clear()
    rng = random.Random(0)
    torch.manual_seed(0)
    decode_lens = sorted([rng.randint(1, 40) for _ in range(9)] + [16, 16], reverse=True)  # incl. full blocks
    prefills = [(0, 13), (11, 21)]  # (cached context, new tokens)
    lens = decode_lens + [c + n for c, n in prefills]
    num_blocks = sum(-(-s // BS) for s in lens) + 5
    free = list(range(1, num_blocks))  # block 0 stays unused: padding points at it
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // BS))] for s in lens]

    k_cache = torch.zeros(A.TorchPagedAttention.kv_cache_shape(num_blocks, BS, HK, D), dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    keys = [torch.randn(s, HK, D).to(dtype) for s in lens]
    vals = [torch.randn(s, HK, D).to(dtype) for s in lens]

    def slot(r, p):
        return tables[r][p // BS] * BS + p % BS

    # the cache holds everything but this step's tokens (written by forward)
    new_rows = [(r, s - 1, s) for r, s in enumerate(decode_lens)]
    new_rows += [(len(decode_lens) + i, c, c + n) for i, (c, n) in enumerate(prefills)]
    for r, first_new, _ in new_rows:
        for p in range(first_new):
            k_cache.view(HK, -1, D)[:, slot(r, p)] = keys[r][p]
            v_cache.view(HK, -1, D)[:, slot(r, p)] = vals[r][p]

    q_parts, k_parts, v_parts, slots = [], [], [], []
    for r, a, b in new_rows:
        q_parts.append(torch.randn(b - a, HQ, D).to(dtype))
        k_parts.append(keys[r][a:b])
        v_parts.append(vals[r][a:b])
        slots += [slot(r, p) for p in range(a, b)]
    q, k, v = torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts)

    nd = len(decode_lens)
    meta = A.AttentionMetadata(slot_mapping=torch.tensor(slots), num_decodes=nd)
    meta.decode_groups = A.build_decode_groups(tables[:nd], decode_lens, BS, HK, HQ // HK, num_blocks,
                                               torch.device("cpu"))
    assert len(meta.decode_groups) > 2 and any(g.key_bias is not None for g in meta.decode_groups)
    row = nd
    for i, (c, n) in enumerate(prefills):
        meta.prefills.append(A.PrefillChunk(row, row + n, c, torch.tensor(tables[nd + i])))
        row += n
    attn = A.TorchPagedAttention(HQ, HK, D, D ** -0.5)
    out = attn.forward(q, k, v, (k_cache, v_cache), meta).view(-1, HQ, D)

    tol = 1e-5 if dtype == torch.float32 else 3e-2
    start = 0
    for (r, a, b), qp in zip(new_rows, q_parts):
        want = dense(qp, keys[r][:b], vals[r][:b], a)
        got = out[start:start + (b - a)].double()
        assert torch.allclose(got, want, atol=tol, rtol=tol), f"request {r}: {(got - want).abs().max()}"
        start += b - a


def test_plan_decode_groups_bounds_padding_and_size():
    nblocks = [50, 48, 40, 37, 36, 20, 3, 3, 1]
    groups = A.plan_decode_groups(nblocks, 16, max_tokens=2048, fill=0.75)
    assert [(s, e) for s, e, _ in groups] == [(0, 2), (2, 5), (5, 6), (6, 8), (8, 9)]
    for s, e, mb in groups:
        assert mb == nblocks[s] and all(nblocks[i] >= 0.75 * mb for i in range(s, e))
        assert e - s == 1 or (e - s) * mb * 16 <= 2048


# ---------------------------------------------------------------------------- the cpu backend (C kernels)

# small pool and step budget: prompts split into chunks, requests preempted, shared prefixes hit;
# then a generous budget: prompts longer than the kernel's query limit take torch's prefill path
CPU_REGIMES = {
    "pressure": dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=16, max_num_seqs=4,
                     enable_prefix_caching=True),
    "long_chunks": dict(block_size=8, num_kv_blocks=64, max_num_batched_tokens=64, enable_prefix_caching=True),
}


def _workload(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(9)]  # two full blocks + 1: cacheable
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    prompts.append([rng.randrange(3, vocab) for _ in range(5)])
    return prompts


def _run_engine(model_dir, backend, regime, prompts):
    from asyncengine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", device="cpu", attention_backend=backend, **CPU_REGIMES[regime])
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    # the second batch hits the prefix blocks the first one cached
    outs = llm.generate(prompts[:3], sp, use_tqdm=False) + llm.generate(prompts[3:], sp, use_tqdm=False)
    eng = llm.engine
    assert eng.kv.num_free_blocks == eng.num_blocks, "KV blocks leaked"
    return llm, outs, eng.stats()


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("regime", list(CPU_REGIMES))
def test_engine_cpu_backend_matches_torch(tiny_llama_dir, regime, monkeypatch):
    """Same greedy tokens and logprobs as the torch backend, with chunked prefill, prefix-cache hits
    and (under pressure) preemption in play; with long_chunks, steps mix kernel rows with chunks
    over the backend's torch prefill path."""
    from asyncengine.attention import cpu_backend
    from asyncengine.kernels.cpu import attention as kernel

    monkeypatch.setattr(cpu_backend, "KERNEL_MAX_QUERY_LEN", 16)

    assert kernel.available(), "the CPU kernels did not build"
    prompts = _workload(512)
    ref_llm, ref, ref_stats = _run_engine(tiny_llama_dir, "torch", regime, prompts)
    llm, got, stats = _run_engine(tiny_llama_dir, "cpu", regime, prompts)
    from worker_hooks import runner_of

    backend = llm.engine.collective_rpc(runner_of)[0].attn_backend
    assert backend.name == "cpu" and backend.kernels
    assert stats["prefix_cache_hits"] > 0
    if regime == "pressure":
        assert stats["num_preemptions"] > 0
    else:
        assert max(map(len, prompts)) > 16  # some chunk went through torch's prefill path
    assert stats["num_steps"] == ref_stats["num_steps"]
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lr.keys() == lg.keys()
            for tok in lr:
                assert abs(lr[tok].logprob - lg[tok].logprob) < 1e-4


@pytest.mark.usefixtures("one_torch_thread")
def test_cpu_backend_without_kernels(tiny_llama_dir, monkeypatch):
    """ASYNCENGINE_CPU_KERNELS=0: auto resolves to torch, and an explicit 'cpu' runs the torch
    backend's attention (same cache layout) with the same tokens."""
    from asyncengine.attention import get_backend, resolve_backend_name
    from asyncengine.kernels.cpu import attention as kernel
    from asyncengine.kernels.cpu import build, ops

    prompts = _workload(512, seed=1)
    _, want, _ = _run_engine(tiny_llama_dir, "cpu", "pressure", prompts)
    monkeypatch.setenv("ASYNCENGINE_CPU_KERNELS", "0")
    for mod in (build, ops, kernel):
        mod._reset_for_tests()
    try:
        assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
        be = get_backend("cpu", num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8,
                         dtype=torch.float32, device=torch.device("cpu"))
        assert not be.kernels and be.kv_cache_shape() == (2, 8, 4, 16)
        _, got, _ = _run_engine(tiny_llama_dir, "cpu", "pressure", prompts)
    finally:
        monkeypatch.delenv("ASYNCENGINE_CPU_KERNELS")
        for mod in (build, ops, kernel):
            mod._reset_for_tests()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"
