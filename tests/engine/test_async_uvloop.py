"""The AsyncLLMEngine scenarios of test_async_engine.py again, on uvloop and under anyio.

Each test drives its own loop: ``asyncio.Runner(loop_factory=uvloop.new_event_loop)`` for uvloop,
``anyio.run(..., backend="asyncio")`` for anyio (task groups and cancel scopes over asyncio, with
and without uvloop underneath).
"""
from __future__ import annotations

import asyncio

import pytest

uvloop = pytest.importorskip("uvloop")
anyio = pytest.importorskip("anyio")

from test_async_engine import (  # noqa: E402  (shared scenarios and fixtures)
    PARITY_REQS, collect, greedy, guard, make_engine, assert_clean, model_dir, offline, scenario_bad_requests,
    scenario_cancellations, scenario_interleave, scenario_model_fault, scenario_output_kinds, scenario_overload,
    scenario_parity, scenario_shutdown, scenario_slow_consumer)

__all__ = ["model_dir", "offline"]  # fixtures re-exported for this module


def run_on_uvloop(coro_fn, *args):
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
        return runner.run(coro_fn(*args))


def test_uvloop_64_streams_match_offline(model_dir, offline, hf_reference):
    report = run_on_uvloop(scenario_parity, model_dir, offline, hf_reference, True)
    print(f"\nparity on uvloop: {report}")


def test_uvloop_streams_interleave(model_dir):
    run_on_uvloop(scenario_interleave, model_dir)


def test_uvloop_cancellations(model_dir):
    run_on_uvloop(scenario_cancellations, model_dir, 2)


def test_uvloop_overload(model_dir):
    run_on_uvloop(scenario_overload, model_dir)


def test_uvloop_model_fault(model_dir):
    run_on_uvloop(scenario_model_fault, model_dir)


def test_uvloop_bad_requests(model_dir):
    run_on_uvloop(scenario_bad_requests, model_dir)


@pytest.mark.parametrize("drain", [True, False], ids=["drain", "abort"])
def test_uvloop_shutdown(model_dir, drain):
    run_on_uvloop(scenario_shutdown, model_dir, drain)


def test_uvloop_output_kinds_and_slow_consumer(model_dir):
    run_on_uvloop(scenario_output_kinds, model_dir)
    run_on_uvloop(scenario_slow_consumer, model_dir)


def test_uvloop_successive_loops_rebind(model_dir):
    """One engine, used in turn from uvloop, plain asyncio and uvloop again."""
    eng = make_engine(model_dir)

    async def one():
        toks, _, last = await guard(collect(eng.generate([3, 4, 5], greedy(6))))
        assert last.finish_reason == "length"
        return toks

    a = run_on_uvloop(one)
    b = asyncio.run(one())

    async def last():
        r = await one()
        await assert_clean(eng)
        await eng.shutdown()
        return r

    c = run_on_uvloop(last)
    assert a == b == c and not eng.errored


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "asyncio+uvloop"])
def test_anyio_task_group(model_dir, use_uvloop):
    """Streams consumed from an anyio task group; a cancel scope cancelling some of them aborts their
    requests in the engine; the rest complete exactly as when run alone."""
    eng = make_engine(model_dir)
    reqs = PARITY_REQS[:12]

    async def main():
        async with eng:
            solo = [await eng.complete({"prompt_token_ids": p}, greedy(m)) for p, m in reqs]
            results: dict[int, list[int]] = {}
            cancelled: list[int] = []

            async def consume(i, p, m):
                toks = []
                async for out in eng.generate({"prompt_token_ids": p}, greedy(m)):
                    toks += out.token_ids_delta
                results[i] = toks

            async def doomed(i, p):
                with anyio.CancelScope() as scope:
                    async for out in eng.generate({"prompt_token_ids": p}, greedy(500)):
                        if len(out.outputs[0].token_ids) >= 3:
                            scope.cancel()  # the next await inside the stream is cancelled
                cancelled.append(i)

            with anyio.fail_after(120):  # hang guard only
                async with anyio.create_task_group() as tg:
                    for i, (p, m) in enumerate(reqs):
                        tg.start_soon(consume, i, p, m)
                    for i in range(6):
                        tg.start_soon(doomed, i, reqs[i][0])
            assert sorted(cancelled) == list(range(6))
            for i, s in enumerate(solo):
                assert results[i] == list(s.outputs[0].token_ids)
            await assert_clean(eng)

    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": use_uvloop})
