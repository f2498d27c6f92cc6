"""The CPU thread governor (asyncengine/worker/cpu_threads.py): how many intra-op threads a worker
runs with when other processes load the machine, decided from synthetic CPU-time samples, and the
worker applying the decision on its model thread (or leaving a pinned count alone)."""
from __future__ import annotations

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.worker.cpu_threads import ThreadGovernor, cores_left, read_cpu_times


@pytest.mark.parametrize("other, cpus, max_threads, want", [
    (0.0, 2, 2, 2), (0.4, 2, 2, 2), (0.6, 2, 2, 1), (1.0, 2, 2, 1), (2.0, 2, 2, 1),
    (0.0, 8, 4, 4), (5.2, 8, 4, 3), (7.9, 8, 4, 1)])
def test_cores_left(other, cpus, max_threads, want):
    assert cores_left(other, cpus, max_threads) == want


class FakeMachine:
    """A 2-core machine: each tick of 0.5 s, other processes use ``other`` cores, we use ``own``."""

    def __init__(self) -> None:
        self.t, self.busy, self.mine = 0.0, 0.0, 0.0

    def tick(self, other: float, own: float = 1.9, dt: float = 0.5) -> None:
        self.t += dt
        self.busy += (other + own) * dt
        self.mine += own * dt

    def governor(self, max_threads: int = 2) -> ThreadGovernor:
        return ThreadGovernor(max_threads, num_cpus=2, read=lambda: (self.busy, self.mine), clock=lambda: self.t)


def test_governor_yields_to_sustained_load_only():
    m = FakeMachine()
    g = m.governor()
    decisions = []
    for other in (0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1):
        m.tick(other, own=1.9 if g.threads == 2 else 1.0)
        decisions.append(g.update())
    # a one-interval burst changes nothing; the second busy interval in a row does; so does idle
    assert decisions == [None, None, None, None, None, 1, None, None, 2, None]
    assert g.threads == 2


def test_governor_waits_for_its_interval_and_is_off_where_it_cannot_help():
    m = FakeMachine()
    g = m.governor()
    m.tick(1.0, dt=0.2)
    assert g.update() is None  # not half a second yet: not even a sample
    m.tick(1.0, dt=0.4)
    assert g.update() is None and g._pending == 1
    assert not m.governor(max_threads=1).enabled  # nothing to give back
    off = ThreadGovernor(2, num_cpus=2, read=lambda: None)
    assert not off.enabled and off.update() is None  # no /proc/stat


def test_read_cpu_times_counts_this_process():
    first = read_cpu_times()
    if first is None:
        pytest.skip("no /proc/stat on this OS")
    sum(i * i for i in range(300_000))  # some CPU time of our own
    busy, own = read_cpu_times()
    assert own > first[1] and busy >= first[0]


@pytest.mark.parametrize("pinned", [None, 1])
def test_the_worker_applies_the_governor_unless_the_count_is_pinned(tiny_llama_dir, monkeypatch, pinned):
    import torch

    monkeypatch.setattr(ThreadGovernor, "update", lambda self: 1)  # "the machine is busy"
    before = torch.get_num_threads()
    llm = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=32, num_threads=pinned)
    try:
        governed = llm.engine.collective_rpc(lambda w: w.threads is not None)[0]
        assert governed == (pinned is None)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        assert llm.engine.collective_rpc("runner_stats")[0]["num_threads"] == 1
    finally:
        llm.shutdown()
        torch.set_num_threads(before)  # torch keeps the last count as the default of new threads
