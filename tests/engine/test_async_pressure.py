"""AsyncLLMEngine under KV-cache pressure: token parity with transformers while requests are
preempted, with two steps in flight (overlap) and with one, prefix caching on and off, ``n > 1``
samples included.

24 blocks of 4 tokens (96 slots) for 18 concurrent requests of up to 84 tokens each: the busy loop
must preempt (asserted through the engine's public ``stats()``), and every request (every sample:
greedy, so each equals the reference) must still equal transformers' greedy fp32 output, up to
reference near-ties (``model_utils.compare``). The pool is whole again at the end.
"""
from __future__ import annotations

import asyncio

import pytest

from asyncengine import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from model_utils import assert_stages_in_order, compare

HANG_GUARD_S = 300.0

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-caching"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "no-overlap"])
async def test_parity_under_preemption(tiny_llama_dir, tiny_reference, async_scheduling, caching):
    requests, refs = tiny_reference("llama")
    assert max(len(p) + m for p, m in requests) <= 96 < sum(len(p) + m for p, m in requests)
    eng = AsyncLLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", num_kv_blocks=24, block_size=4,
                                      max_num_batched_tokens=64, async_scheduling=async_scheduling,
                                      enable_prefix_caching=caching))
    ns = [2 if i % 3 == 0 else 1 for i in range(len(requests))]  # every third request: two samples
    async with eng:
        finals = await asyncio.wait_for(asyncio.gather(*(
            eng.complete({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True,
                                                                 n=n), request_id=f"q{i}")
            for i, ((p, m), n) in enumerate(zip(requests, ns)))), HANG_GUARD_S)
        stats = eng.stats()
    got, want = [], []
    for out, n, ref in zip(finals, ns, refs):
        assert out.finished and [c.index for c in out.outputs] == list(range(n))
        for c in out.outputs:
            assert c.finish_reason == "length"
            got.append(list(c.token_ids))
            want.append(ref)
    counts = compare(got, want)  # raises on a real mismatch
    assert counts["exact"] + counts["near_tie"] == len(got) == len(requests) + ns.count(2)
    print(f"\n[pressure] preemptions {stats['num_preemptions']}, near-ties {counts['near_tie']} of {len(got)}")
    assert stats["num_preemptions"] > 0, stats
    # each request's own account: its preemptions (n > 1: its most preempted sample) and its stages in order
    assert 0 < sum(out.metrics.num_preemptions for out in finals) <= stats["num_preemptions"]
    for out in finals:
        assert_stages_in_order(out.metrics)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] == 24
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_offline_outputs_carry_the_same_metrics(tiny_llama_dir, tiny_reference):
    requests, _ = tiny_reference("llama")
    llm = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=24, block_size=4, max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests],
                        [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in requests])
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for o in outs:
        assert_stages_in_order(o.metrics)
