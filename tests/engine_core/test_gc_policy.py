"""The cycle collector is paused while an engine loads (engine_core/gc_policy.py): a full collection
walks torch's ~1M objects, and a load used to trigger three of them (~0.2 s of a one-line chat)."""
from __future__ import annotations

import gc
import threading

import pytest

from asyncengine.engine_core import gc_policy


@pytest.fixture(autouse=True)
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_nests_and_resumes_after_the_last():
    with gc_policy.paused():
        assert not gc.isenabled()
        with gc_policy.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer load is still running
    assert gc.isenabled()


def test_paused_leaves_a_disabled_collector_disabled_and_can_be_off():
    gc.disable()
    with gc_policy.paused():
        pass
    assert not gc.isenabled()  # the app had turned it off: not ours to turn on
    gc.enable()
    with gc_policy.paused(enabled=False):
        assert gc.isenabled()


def test_paused_across_threads_resumes_once_both_are_done():
    inside, release = threading.Event(), threading.Event()

    def other_load():
        with gc_policy.paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other_load)
    t.start()
    inside.wait(10)
    with gc_policy.paused():
        pass
    assert not gc.isenabled()  # the other thread's load is not finished
    release.set()
    t.join(10)
    assert gc.isenabled()


@pytest.mark.parametrize("freeze", [True, False])
def test_engine_loads_with_the_collector_paused(tiny_llama_dir, monkeypatch, freeze):
    from asyncengine import AsyncLLMEngine, EngineConfig
    from asyncengine.engine_core import core as engine_core

    seen = []
    real = engine_core.EngineCore.__init__

    def spy(self, *a, **kw):
        seen.append(gc.isenabled())
        real(self, *a, **kw)

    monkeypatch.setattr(engine_core.EngineCore, "__init__", spy)
    frozen_before = gc.get_freeze_count()
    eng = AsyncLLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", num_kv_blocks=16,
                                      freeze_gc_after_load=freeze))
    try:
        assert seen == [not freeze]
        assert gc.isenabled()
        assert (gc.get_freeze_count() > frozen_before) == freeze
    finally:
        eng.core.shutdown()
        gc.unfreeze()
