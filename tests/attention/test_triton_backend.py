"""The triton attention backend through the whole engine, on CPU under TRITON_INTERPRET=1: the
same greedy tokens and logprobs as the torch backend on a tiny fp32 model, in a regime with
chunked prefill, prefix-cache hits and preemption all in play. Plus the backend seam itself: the
selector, the cache layouts, and a padded (CUDA-graph sized) decode batch giving the same rows."""
from __future__ import annotations

import random

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.attention import SeqChunk, StepBatch, get_backend, resolve_backend_name
from asyncengine.config import EngineConfig
from asyncengine.errors import ConfigError

# small pool and step budget: prompts split into chunks, requests preempted, shared prefixes hit
REGIME = dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)


@pytest.fixture
def interpret(monkeypatch):
    try:
        import triton  # noqa: F401
    except ImportError as e:  # pragma: no cover - triton is in the dev extra
        pytest.fail(f"these tests need triton (pip install -e '.[dev]'): {e}", pytrace=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def workload(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(9)]  # two full blocks + 1: cacheable
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(3, 14))] for _ in range(4)]
    prompts.append([rng.randrange(3, vocab) for _ in range(5)])
    return prompts


def run(model_dir: str, backend: str, prompts):
    llm = LLM(model_dir, dtype="float32", device="cpu", attention_backend=backend, **REGIME)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    # the second batch hits the prefix blocks the first one cached
    outs = llm.generate(prompts[:3], sp, use_tqdm=False) + llm.generate(prompts[3:], sp, use_tqdm=False)
    stats = llm.engine.stats()
    eng = llm.engine
    assert eng.kv.num_free_blocks == eng.num_blocks, "KV blocks leaked"
    return outs, stats


@pytest.mark.usefixtures("one_torch_thread")
def test_engine_triton_matches_torch(tiny_llama_dir, interpret):
    prompts = workload(512)
    assert max(map(len, prompts)) > REGIME["max_num_batched_tokens"]  # some prompt runs in chunks
    ref, ref_stats = run(tiny_llama_dir, "torch", prompts)
    got, stats = run(tiny_llama_dir, "triton", prompts)
    # the regime exercised what it should (same schedule on both backends)
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_steps"] == ref_stats["num_steps"]
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lr.keys() == lg.keys()
            for tok in lr:
                assert abs(lr[tok].logprob - lg[tok].logprob) < 1e-4


def test_selector_and_config(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend_name("auto", cpu) in ("cpu", "torch")  # cpu where the C kernels build
    assert resolve_backend_name("torch", cuda) == "torch"
    assert resolve_backend_name("triton", cpu) == "triton"
    monkeypatch.setattr("asyncengine.kernels.triton_available", lambda: True)
    assert resolve_backend_name("auto", cuda) == "triton"
    monkeypatch.setattr("asyncengine.kernels.triton_available", lambda: False)
    assert resolve_backend_name("auto", cuda) == "torch"  # no triton: still runs, on torch
    with pytest.raises(ConfigError):
        resolve_backend_name("flash", cpu)
    with pytest.raises(ConfigError):
        EngineConfig(attention_backend="flash", device="cpu")
    assert EngineConfig(device="cpu").attention_backend_name in ("cpu", "torch")
    with pytest.raises(ConfigError):
        EngineConfig(device="cpu", gpu_memory_utilization=1.5)


def test_triton_backend_refuses_without_interpreter_or_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        get_backend("triton", num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8,
                    dtype=torch.float32, device=torch.device("cpu"))


def _shapes(backend, **kw):
    return get_backend(backend, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=32,
                       dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=64, max_num_seqs=8,
                       max_blocks_per_seq=8, **kw)


def test_padded_decode_batch_matches_unpadded(interpret):
    """A decode batch padded to a larger (captured) size: padding sequences own no query rows and
    padding tokens slot -1, so the real rows and the cache come out exactly as without padding."""
    torch.manual_seed(0)
    be = _shapes("triton")
    assert be.kv_cache_shape() == (32, 4, 2, 16)
    assert _shapes("torch").kv_cache_shape() == (2, 32, 4, 16)
    rng = random.Random(0)
    perm = rng.sample(range(32), 32)  # non-contiguous block tables
    ctx = [13, 4, 7]
    seqs, slots, used = [], [], 0
    for i, c in enumerate(ctx):
        nb = c // 4 + 1
        blocks = perm[used:used + nb]
        used += nb
        seqs.append(SeqChunk(query_start=i, query_len=1, context_len=c, block_ids=blocks))
        slots.append(blocks[c // 4] * 4 + c % 4)
    batch = StepBatch(seqs=seqs, slot_mapping=slots, num_decodes=3)
    caches = be.allocate_kv_caches(1)[0]
    for t in caches:
        t.normal_()
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    c1 = tuple(t.clone() for t in caches)
    want = be.forward(q, k, v, c1, be.build_metadata(batch)).clone()
    pad = 8
    qp, kp, vp = (torch.cat([x, torch.full((pad - 3, *x.shape[1:]), 5.0)]) for x in (q, k, v))
    c2 = tuple(t.clone() for t in caches)
    meta = be.build_metadata(batch, pad_tokens=pad, pad_seqs=pad)
    assert meta.slot_mapping.tolist()[3:] == [-1] * 5 and meta.query_start_loc.tolist()[3:] == [3] * 6
    got = be.forward(qp, kp, vp, c2, meta)
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(c1[0], c2[0]) and torch.equal(c1[1], c2[1])


def test_backends_agree_on_a_mixed_step(interpret):
    """One step holding a decode, a decode carrying 3 tokens (speculative: several query tokens
    over cached context), a chunk after cached context and a fresh prompt, over shuffled blocks:
    the triton backend's rows equal the torch backend's, whose cache layout differs."""
    torch.manual_seed(1)
    tri, ref = _shapes("triton"), _shapes("torch")
    rng = random.Random(1)
    perm = rng.sample(range(32), 32)
    specs = [(1, 9), (3, 6), (5, 4), (7, 0)]  # (query_len, context_len)
    seqs, slots, used, row = [], [], 0, 0
    for ql, c in specs:
        nb = -(-(c + ql) // 4)
        blocks = perm[used:used + nb]
        used += nb
        seqs.append(SeqChunk(query_start=row, query_len=ql, context_len=c, block_ids=blocks))
        slots += [blocks[p // 4] * 4 + p % 4 for p in range(c, c + ql)]
        row += ql
    batch = StepBatch(seqs=seqs, slot_mapping=slots, num_decodes=1)
    kt, vt = (t.normal_() for t in tri.allocate_kv_caches(1)[0])  # [blocks, bs, Hkv, D]
    kr, vr = kt.permute(2, 0, 1, 3).contiguous(), vt.permute(2, 0, 1, 3).contiguous()  # [Hkv, blocks, bs, D]
    q, k, v = torch.randn(row, 4, 16), torch.randn(row, 2, 16), torch.randn(row, 2, 16)
    got = tri.forward(q, k, v, (kt, vt), tri.build_metadata(batch))
    want = ref.forward(q, k, v, (kr, vr), ref.build_metadata(batch))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kt.permute(2, 0, 1, 3), kr, atol=0, rtol=0)
