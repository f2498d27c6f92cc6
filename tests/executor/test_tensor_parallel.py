"""Tensor parallelism end to end: TP=2 over two worker processes (``mp``, gloo, one thread per
rank) against transformers and against TP=1, on two architectures: the tiny llama (4 query heads,
2 KV heads: one KV head per rank) and an MQA qwen2 (1 KV head, replicated on both ranks; QKV bias
sharded too). Chunked prefill, preemption and prefix caching are all in play (a small token budget
and a small KV cache), under the priority policy; then seeded sampling, n > 1, logprobs and prompt
logprobs, stop strings, cancellation and the overlapped busy loop, each under TP=2.

Engines are module-scoped: starting worker processes costs seconds."""
from __future__ import annotations

import asyncio
import random

import pytest

from asyncengine import AsyncLLMEngine, EngineConfig, SamplingParams
from asyncengine.engine_core.core import EngineCore
from model_utils import compare

HANG_GUARD_S = 180.0  # a guard against hangs only

# chunked prefill (budget 40 < the longest prompts), preemption (24 blocks of 16 tokens for
# 8 running requests of up to 84 tokens), prefix caching (on by default), priority policy
COMMON = dict(dtype="float32", num_threads=1, max_num_seqs=8, max_num_batched_tokens=40, num_kv_blocks=24,
              policy="priority", freeze_gc_after_load=False, seed=0)


def tp_config(model_dir: str, tp: int, **kw) -> EngineConfig:
    backend = "mp" if tp > 1 else "uni"
    return EngineConfig(model=model_dir, tensor_parallel_size=tp, distributed_executor_backend=backend,
                        **{**COMMON, **kw})


async def guard(aw):
    return await asyncio.wait_for(aw, HANG_GUARD_S)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


async def run_all(eng: AsyncLLMEngine, requests, params_of=greedy, priorities=None):
    """Submit every request at once (so they batch, chunk and preempt); final outputs in order."""
    async def one(i, ids, n):
        return await eng.complete({"prompt_token_ids": ids}, params_of(n), request_id=f"r{i}",
                                  priority=priorities[i] if priorities else 0)
    return await guard(asyncio.gather(*(one(i, ids, n) for i, (ids, n) in enumerate(requests))))


def with_shared_prefixes(requests):
    """The parity workload plus requests that extend earlier prompts (prefix-cache hits)."""
    extra = [(ids + [7, 8, 9, 10 + i], 6) for i, (ids, _) in enumerate(requests[:4]) if len(ids) >= 20]
    return requests + extra


@pytest.fixture(scope="module")
def llama_tp2(tiny_llama_dir):
    core = EngineCore(tp_config(tiny_llama_dir, 2))
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def llama_tp1(tiny_llama_dir):
    core = EngineCore(tp_config(tiny_llama_dir, 1))
    yield core
    core.shutdown()


def engine(core: EngineCore) -> AsyncLLMEngine:
    return AsyncLLMEngine(core.config, core=core)


async def assert_clean(eng: AsyncLLMEngine) -> None:
    """Nothing left anywhere: every block free, and (after one more step tells them) no request
    state on any rank."""
    probe = await guard(eng.complete([5, 6, 7], greedy(1), request_id="probe"))
    assert probe.finished
    for _ in range(200):
        if eng.core.num_running == 0 and eng.core.num_waiting == 0:
            break
        await asyncio.sleep(0.01)
    assert eng.core.kv.num_free_blocks == eng.core.num_blocks
    for rank in eng.core.collective_rpc("runner_stats"):
        assert set(rank["request_ids"]) <= {"probe"}, rank


async def test_greedy_parity_llama(llama_tp2, llama_tp1, tiny_llama_dir, tiny_reference, hf_reference):
    requests, _ = tiny_reference("llama")
    requests = with_shared_prefixes(requests)
    refs = hf_reference(tiny_llama_dir, requests)
    prio = [random.Random(i).randrange(3) for i in range(len(requests))]
    eng2 = engine(llama_tp2)
    s0 = llama_tp2.stats()
    outs2 = await run_all(eng2, requests, priorities=prio)
    s1 = llama_tp2.stats()
    outs1 = await run_all(engine(llama_tp1), requests, priorities=prio)
    toks2 = [o.outputs[0].token_ids for o in outs2]
    toks1 = [o.outputs[0].token_ids for o in outs1]
    c2, c1 = compare(toks2, refs), compare(toks1, refs)
    print(f"[tp] llama TP=2 vs transformers {c2}, TP=1 {c1}")
    assert c2["exact"] + c2["near_tie"] == len(requests)
    # TP=2 and TP=1 agree wherever neither had to be excused at a near-tie
    assert sum(a == b for a, b in zip(toks2, toks1)) >= len(requests) - c1["near_tie"] - c2["near_tie"]
    # the machinery this run was meant to exercise did run under TP=2
    assert s1["num_preemptions"] > s0["num_preemptions"], s1
    assert s1["prefix_cache_hits"] > s0["prefix_cache_hits"], s1
    assert s1["mean_scheduled_tokens_per_step"] <= COMMON["max_num_batched_tokens"]
    assert any(len(ids) > COMMON["max_num_batched_tokens"] for ids, _ in requests)  # chunked prompts
    await assert_clean(eng2)


async def test_sampling_features_match_tp1(llama_tp2, llama_tp1):
    """Seeded sampling (n=2, each sample its own seed), logprobs and prompt logprobs, and stop
    strings give under TP=2 what they give under TP=1."""
    prompt = list(range(40, 70))
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=1234, n=2, ignore_eos=True,
                            logprobs=3, prompt_logprobs=2)
    e1, e2 = engine(llama_tp1), engine(llama_tp2)
    a = await guard(e1.complete({"prompt_token_ids": prompt}, seeded))
    b = await guard(e2.complete({"prompt_token_ids": prompt}, seeded))
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids  # two different samples
    for oa, ob in zip(a.outputs, b.outputs):
        for da, db in zip(oa.logprobs, ob.logprobs):
            assert da.keys() == db.keys()
            for t in da:
                assert abs(da[t].logprob - db[t].logprob) < 1e-4 and da[t].rank == db[t].rank
    for da, db in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert da.keys() == db.keys() and all(abs(da[t].logprob - db[t].logprob) < 1e-4 for t in da)

    # stop strings: stop at a piece of text from the middle of TP=1's greedy answer
    text = "The quick brown fox"
    full = await guard(e1.complete(text, greedy(24)))
    answer = full.outputs[0].text
    stop = answer[len(answer) // 2:len(answer) // 2 + 3]
    assert stop.strip(), answer
    s1 = await guard(e1.complete(text, greedy(24, stop=[stop])))
    s2 = await guard(e2.complete(text, greedy(24, stop=[stop])))
    assert s2.outputs[0].finish_reason == "stop" and s2.outputs[0].stop_reason == stop
    assert s2.outputs[0].text == s1.outputs[0].text and len(s2.outputs[0].text) < len(answer)
    await assert_clean(e2)


async def test_cancellation_and_overlap(llama_tp2):
    """Streams cancelled mid-way under TP=2 with two steps in flight: the rest finish, and every
    rank forgets the cancelled ones."""
    eng = engine(llama_tp2)
    assert eng.config.async_scheduling  # the overlapped busy loop: two steps queued in the pipes
    streams = [eng.generate({"prompt_token_ids": [9 + i, 20, 30, 40]}, greedy(60), request_id=f"c{i}")
               for i in range(6)]

    async def read(i, s):
        n = 0
        async for out in s:
            n += 1
            if i % 2 == 0 and n == 3:
                await s.aclose()  # the client leaves: an abort reaches the core and the workers
                return "cancelled"
        return out.outputs[0].finish_reason

    results = await guard(asyncio.gather(*(read(i, s) for i, s in enumerate(streams))))
    assert results == ["cancelled", "length"] * 3
    await assert_clean(eng)


async def test_two_steps_in_flight(llama_tp2):
    """The overlap under TP=2, seen at the executor: with the overlapped busy loop each decode step
    is handed to the workers while the one before is still running there (the workers are slowed
    so that a step cannot finish before the next is queued); the same core driven without
    async_scheduling never has two in flight. Both give the same tokens."""
    import dataclasses

    from worker_hooks import restore_execute, slow_steps

    llama_tp2.collective_rpc(slow_steps, (0.25,))
    try:
        toks, overlapped = {}, {}
        for overlap in (False, True):
            # the core owns the step pipeline: its queue depth is what async_scheduling sets
            llama_tp2.batch_queue_size = 2 if overlap else 1
            eng = AsyncLLMEngine(dataclasses.replace(llama_tp2.config, async_scheduling=overlap), core=llama_tp2)
            before = llama_tp2.stats()["num_overlapped_steps"]
            out = await guard(eng.complete({"prompt_token_ids": [11, 12, 13, 14]}, greedy(6),
                                           request_id=f"ov{overlap}"))
            await eng.shutdown()
            overlapped[overlap] = llama_tp2.stats()["num_overlapped_steps"] - before
            toks[overlap] = out.outputs[0].token_ids
    finally:
        llama_tp2.collective_rpc(restore_execute)
        llama_tp2.batch_queue_size = llama_tp2.executor.max_concurrent_batches
    assert overlapped[False] == 0, overlapped
    # 6 steps (1 prefill, 5 decodes): all but the first can be; a very slow event loop may miss one
    assert overlapped[True] >= 3, overlapped
    assert toks[True] == toks[False] and len(toks[True]) == 6


def test_worker_holds_half_the_weights(llama_tp2, llama_tp1):
    full = llama_tp1.collective_rpc("runner_stats")[0]["weight_bytes"]
    ranks = llama_tp2.collective_rpc("runner_stats")
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    for r in ranks:
        assert abs(r["weight_bytes"] / full - 0.5) < 0.02, (r, full)


async def test_mqa_parity(tiny_model_dir, hf_reference):
    """One KV head (multi-query attention), replicated on both ranks; a qwen2 (QKV bias)."""
    d = tiny_model_dir("qwen2", num_key_value_heads=1)
    from model_utils import random_requests

    requests = with_shared_prefixes(random_requests(12, 512, seed=7, plen=(3, 60), olen=(1, 24)))
    refs = hf_reference(d, requests)
    core = EngineCore(tp_config(d, 2))
    try:
        outs = await run_all(engine(core), requests)
        stats = core.stats()
    finally:
        core.shutdown()
    c = compare([o.outputs[0].token_ids for o in outs], refs)
    print(f"[tp] qwen2 MQA TP=2 vs transformers {c}")
    assert c["exact"] + c["near_tie"] == len(requests)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats


async def test_replicated_vocabulary(tiny_llama_dir, tiny_reference, llama_tp1):
    """tp_vocab_parallel=False (embedding and LM head whole on every rank, rank 0 alone computes
    the logits): greedy parity with transformers, seeded samples and logprobs equal to TP=1's."""
    requests, refs = tiny_reference("llama")
    requests, refs = requests[:10], refs[:10]
    core = EngineCore(tp_config(tiny_llama_dir, 2, tp_vocab_parallel=False))
    try:
        eng = engine(core)
        outs = await run_all(eng, requests)
        c = compare([o.outputs[0].token_ids for o in outs], refs)
        print(f"[tp] llama TP=2, replicated vocabulary, vs transformers {c}")
        assert c["exact"] + c["near_tie"] == len(requests)
        seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=99, ignore_eos=True, logprobs=2, prompt_logprobs=1)
        prompt = {"prompt_token_ids": list(range(30, 50))}
        a = await guard(engine(llama_tp1).complete(prompt, seeded))
        b = await guard(eng.complete(prompt, seeded))
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs + a.prompt_logprobs[1:], b.outputs[0].logprobs + b.prompt_logprobs[1:]):
            assert da.keys() == db.keys() and all(abs(da[t].logprob - db[t].logprob) < 1e-4 for t in da)
        vocab_rows = [r["weight_bytes"] for r in core.collective_rpc("runner_stats")]
        full = llama_tp1.collective_rpc("runner_stats")[0]["weight_bytes"]
        assert all(0.6 < w / full < 0.9 for w in vocab_rows), (vocab_rows, full)  # vocab whole, the rest halved
    finally:
        core.shutdown()


def test_shutdown_leaves_no_worker(llama_tp2):
    """Last in this module (the fixture's shutdown is idempotent)."""
    from proc_utils import wait_gone

    pids = [r["pid"] for r in llama_tp2.collective_rpc("runner_stats")]
    llama_tp2.shutdown()
    wait_gone(pids, timeout=30.0)
