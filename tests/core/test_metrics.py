"""``EngineCore.stats()`` (and ``LLM.engine.stats()`` / ``AsyncLLMEngine.stats()``): the scheduler
and cache figures move the way the workload says they must.

Keys pinned here: ``prefix_cache_queries`` / ``prefix_cache_hits`` (tokens, counted once per
admission) and ``prefix_cache_hit_rate`` = hits / queries; ``num_computed_prompt_tokens`` (prompt
positions actually computed: hits excluded, recomputes after preemption included);
``kv_usage`` (referenced blocks / all blocks; cached-but-free blocks count as free);
``num_free_kv_blocks``; ``num_kv_evictions``; ``num_preemptions``; ``mean_queue_time_s``
(arrival -> first scheduled, over requests started); ``num_steps`` (steps that computed something),
``num_scheduled_tokens`` and ``mean_scheduled_tokens_per_step`` = their ratio.
"""
from __future__ import annotations

import random
import types

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.engine_core.core import EngineCore
import asyncengine.core.scheduler as scheduler_module
from asyncengine.core.request import Request

from model_utils import make_core  # noqa: E402

VOCAB = 512


pytestmark = pytest.mark.usefixtures("one_torch_thread")




def req(rid: str, prompt, max_tokens: int, arrival_time: float | None = None) -> Request:
    kw = {} if arrival_time is None else {"arrival_time": arrival_time}
    return Request(request_id=rid, prompt_token_ids=list(prompt), max_tokens=max_tokens,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens), **kw)


def run_all(core: EngineCore, reqs, sample=None) -> list[dict]:
    """Add ``reqs``, step to the end; returns ``stats()`` after every step (or ``sample(core)``)."""
    for r in reqs:
        core.add_request(r)
    seen = []
    while core.has_unfinished():
        core.step()
        seen.append(sample(core) if sample else core.stats())
    return seen


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def test_prefix_hit_rate_and_computed_prompt_tokens(tiny):
    rng = random.Random(0)
    prefix = toks(rng, 32)
    core = make_core(tiny, num_kv_blocks=64, block_size=8)
    s0 = core.stats()
    assert s0["prefix_cache_queries"] == s0["prefix_cache_hits"] == 0 and s0["prefix_cache_hit_rate"] == 0.0

    a = prefix + toks(rng, 8)  # 40 tokens
    run_all(core, [req("a", a, 4)])
    s1 = core.stats()
    assert s1["prefix_cache_queries"] == 40 and s1["prefix_cache_hits"] == 0
    assert s1["num_computed_prompt_tokens"] == 40

    b = prefix + toks(rng, 4)  # 36 tokens, 32 of them cached
    run_all(core, [req("b", b, 4)])
    s2 = core.stats()
    assert s2["prefix_cache_queries"] == 76 and s2["prefix_cache_hits"] == 32
    assert s2["prefix_cache_hit_rate"] == pytest.approx(32 / 76)
    assert s2["num_computed_prompt_tokens"] == 40 + 4

    run_all(core, [req("a2", a, 4)])  # a's 40 tokens again: 5 full blocks cached, but the last
    s3 = core.stats()  # token must be computed, so 4 blocks hit and the 5th block's 8 are computed
    assert s3["prefix_cache_hits"] == 64 and s3["num_computed_prompt_tokens"] == 44 + 8
    assert s3["prefix_cache_hit_rate"] == pytest.approx(64 / 116)

    off = make_core(tiny, num_kv_blocks=64, block_size=8, enable_prefix_caching=False)
    run_all(off, [req("a", a, 4), req("b", b, 4)])
    so = off.stats()
    assert so["prefix_cache_queries"] == so["prefix_cache_hits"] == 0 and so["num_computed_prompt_tokens"] == 76


def test_kv_usage_and_free_blocks_follow_the_requests(tiny):
    rng = random.Random(1)
    core = make_core(tiny, num_kv_blocks=20, block_size=4)
    assert core.stats()["kv_usage"] == 0.0
    seen = run_all(core, [req(f"r{i}", toks(rng, 10), 6) for i in range(3)],
                   sample=lambda c: (c.stats()["kv_usage"], c.stats()["num_free_kv_blocks"], c.kv.pool.usage))
    # 3 requests x up to ceil(15 / 4) = 4 blocks: at most 12 of 20 blocks
    assert max(u for u, _, _ in seen) == pytest.approx(12 / 20)
    for usage, free, pool_usage in seen:
        assert usage == pool_usage == pytest.approx(1 - free / 20)
    end = core.stats()
    assert end["kv_usage"] == 0.0 and end["num_free_kv_blocks"] == 20
    assert len(core.kv.pool.cached) > 0  # cached blocks are free (usage 0) but still cached


def test_preemptions_and_evictions_counted(tiny):
    rng = random.Random(2)
    roomy = make_core(tiny, num_kv_blocks=64, block_size=4)
    tight = make_core(tiny, num_kv_blocks=12, block_size=4)  # 48 slots for 4 x 30 tokens
    work = [(toks(rng, 14), 16) for _ in range(4)]
    for core in (roomy, tight):
        run_all(core, [req(f"r{i}", p, m) for i, (p, m) in enumerate(work)])
    assert roomy.stats()["num_preemptions"] == 0 and roomy.stats()["num_kv_evictions"] == 0
    t = tight.stats()
    assert t["num_preemptions"] > 0 and t["num_kv_evictions"] > 0
    # a preempted request recomputes its prompt (part of it may come back from the prefix cache)
    assert t["num_computed_prompt_tokens"] + t["prefix_cache_hits"] > 4 * 14


def test_queue_time(tiny, monkeypatch):
    """One seat: the k-th of 4 simultaneous requests waits for the k-1 before it. The scheduler's clock
    is a step counter here, so the waits are exact (no wall-clock assertion)."""
    clock = [0.0]
    monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    def tick(core):
        clock[0] += 1.0
    rng = random.Random(3)
    core = make_core(tiny, num_kv_blocks=32, block_size=4, max_num_seqs=1)
    run_all(core, [req("solo", toks(rng, 6), 2, arrival_time=clock[0])], tick)
    assert core.stats()["mean_queue_time_s"] == 0.0  # admitted at the first step
    core = make_core(tiny, num_kv_blocks=32, block_size=4, max_num_seqs=1)
    reqs = [req(f"r{i}", toks(rng, 6), 6, arrival_time=clock[0]) for i in range(4)]
    run_all(core, reqs, tick)
    # each holds the seat for 6 steps (prefill + 5 decodes); the next starts on the step after
    waits = [r.first_scheduled_time - r.arrival_time for r in reqs]
    assert waits == [0.0, 6.0, 12.0, 18.0]
    assert core.stats()["mean_queue_time_s"] == 9.0


def test_queue_time_counts_the_first_admission_only(tiny, monkeypatch):
    """A preempted request waits again, but its queue time is arrival -> *first* scheduled (on the
    step clock: exact)."""
    clock = [0.0]
    monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    rng = random.Random(2)
    core = make_core(tiny, num_kv_blocks=12, block_size=4)  # 48 slots for 4 x 30 tokens
    reqs = [req(f"r{i}", toks(rng, 14), 16, arrival_time=0.0) for i in range(4)]
    for r in reqs:
        core.add_request(r)
    first: dict[str, float] = {}
    while core.has_unfinished():
        so = core.schedule()
        for nr in so.new_requests:
            first.setdefault(nr.req_id, clock[0])
        core.update(so, core.execute(so))
        clock[0] += 1.0
    assert core.stats()["num_preemptions"] > 0
    assert {r.request_id: r.first_scheduled_time for r in reqs} == first
    assert core.stats()["mean_queue_time_s"] == sum(first.values()) / 4


def test_scheduled_tokens_per_step(tiny):
    rng = random.Random(4)
    core = make_core(tiny, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert core.stats()["mean_scheduled_tokens_per_step"] == 0.0
    reqs = [req(f"r{i}", toks(rng, 20), 5) for i in range(3)]
    per_step = run_all(core, reqs, sample=lambda c: c.stats()["num_scheduled_tokens"])
    s = core.stats()
    # every token is computed once: 60 prompt tokens + 4 decodes each (the 5th output is never fed back)
    assert s["num_scheduled_tokens"] == 60 + 3 * 4
    assert s["mean_scheduled_tokens_per_step"] == pytest.approx(s["num_scheduled_tokens"] / s["num_steps"])
    deltas = [b - a for a, b in zip([0] + per_step, per_step)]
    assert max(deltas) == 16  # prefill chunks fill the budget
    assert s["num_steps"] == sum(d > 0 for d in deltas)


def test_llm_engine_stats_exposes_everything(tiny):
    model_dir, _ = tiny
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=32, block_size=4)
    rng = random.Random(5)
    p = toks(rng, 12)
    llm.generate([{"prompt_token_ids": p}, {"prompt_token_ids": p + [7]}], SamplingParams(max_tokens=3),
                 use_tqdm=False)
    s = llm.engine.stats()
    for key in ("prefix_cache_hit_rate", "prefix_cache_hits", "prefix_cache_queries", "kv_usage",
                "num_preemptions", "mean_queue_time_s", "mean_scheduled_tokens_per_step",
                "num_computed_prompt_tokens", "num_kv_evictions", "num_steps", "num_scheduled_tokens"):
        assert key in s, key
    assert s["num_computed_prompt_tokens"] + s["prefix_cache_hits"] == s["prefix_cache_queries"] == 25
