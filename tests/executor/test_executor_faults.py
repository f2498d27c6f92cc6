"""Faults under the ``mp`` executor (TP=2): a rank raising in forward, a rank killed, a rank that
loses its peer inside a step. Every waiter gets EngineDeadError (the timeouts here are only hang
guards), check_health notices a dead worker between steps, and no worker process outlives the
engine: not after a fault, not after shutdown, Ctrl-C, or the parent being killed (checked by pid).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from asyncengine import AsyncLLMEngine, EngineConfig, EngineDeadError, SamplingParams
from proc_utils import alive, wait_gone

HANG_GUARD_S = 120.0


def make_engine(model_dir: str) -> AsyncLLMEngine:
    return AsyncLLMEngine(EngineConfig(model=model_dir, dtype="float32", tensor_parallel_size=2,
                                       distributed_executor_backend="mp", num_threads=1, num_kv_blocks=64,
                                       freeze_gc_after_load=False, distributed_timeout_s=30.0))


def worker_pids(eng: AsyncLLMEngine) -> list[int]:
    return [r["pid"] for r in eng.core.collective_rpc("runner_stats")]


async def all_streams_die(eng: AsyncLLMEngine, n: int = 6) -> list[EngineDeadError]:
    streams = [eng.generate({"prompt_token_ids": [5 + i, 6, 7, 8]},
                            SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)) for i in range(n)]

    async def consume(s):
        with pytest.raises(EngineDeadError) as ei:
            async for _ in s:
                pass
        return ei.value
    return await asyncio.wait_for(asyncio.gather(*(consume(s) for s in streams)), HANG_GUARD_S)


async def test_rank_raises_in_forward(tiny_llama_dir):
    from worker_hooks import fail_after

    eng = make_engine(tiny_llama_dir)
    pids = worker_pids(eng)
    eng.core.collective_rpc(fail_after, (3, "rank one exploded"), {"rank": 1})
    async with eng:
        errors = await all_streams_die(eng)
        assert any("rank one exploded" in str(e) or "rank 1" in str(e) for e in errors), errors[0]
        with pytest.raises(EngineDeadError):
            eng.generate([1, 2, 3], SamplingParams(max_tokens=2))
    wait_gone(pids)


async def test_rank_loses_its_peer_inside_a_step(tiny_llama_dir):
    """Rank 1 vanishes mid-step (no error message): rank 0 is left waiting in a collective; the
    executor notices the death and ends it all."""
    from worker_hooks import die_after

    eng = make_engine(tiny_llama_dir)
    pids = worker_pids(eng)
    eng.core.collective_rpc(die_after, (3, 1))
    async with eng:
        errors = await all_streams_die(eng)
        assert "rank 1" in str(errors[0]), errors[0]
    wait_gone(pids)


async def test_killed_worker_noticed_between_steps(tiny_llama_dir):
    eng = make_engine(tiny_llama_dir)
    pids = worker_pids(eng)
    async with eng:
        out = await asyncio.wait_for(eng.complete([5, 6, 7], SamplingParams(max_tokens=3, temperature=0)),
                                     HANG_GUARD_S)
        assert out.finished
        os.kill(pids[0], signal.SIGKILL)  # idle: no step in flight
        with pytest.raises(EngineDeadError):
            for _ in range(int(HANG_GUARD_S * 10)):
                eng.core.check_health()
                await asyncio.sleep(0.1)
        # the idle busy loop found out by itself too: the engine is marked dead
        for _ in range(int(HANG_GUARD_S * 10)):
            if eng.errored:
                break
            await asyncio.sleep(0.1)
        assert eng.errored
        with pytest.raises(EngineDeadError):
            eng.generate([1, 2, 3], SamplingParams(max_tokens=2))
    wait_gone(pids)


SCRIPT = textwrap.dedent("""
    import json, sys, time
    from asyncengine import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2, num_kv_blocks=32)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        print(json.dumps([r["pid"] for r in llm.engine.collective_rpc("runner_stats")]), flush=True)
        time.sleep(120)
""")


def test_no_worker_outlives_its_parent(tiny_llama_dir, tmp_path):
    """Two parents at once: one gets Ctrl-C, one is SIGKILLed (no chance to clean up: the workers
    see their parent vanish). Their workers are gone either way. (A clean shutdown is checked in
    test_tensor_parallel.py.)"""
    script = tmp_path / "parent.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {mode: subprocess.Popen([sys.executable, str(script), tiny_llama_dir], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, env=env)
             for mode in ("sigint", "sigkill")}
    try:
        pids = {mode: json.loads(p.stdout.readline()) for mode, p in procs.items()}
        for mode, ps in pids.items():
            assert len(ps) == 2 and all(alive(x) for x in ps), (mode, ps)
        procs["sigint"].send_signal(signal.SIGINT)
        procs["sigkill"].kill()
        for mode in pids:
            wait_gone(pids[mode])
        assert procs["sigint"].wait(HANG_GUARD_S) != 0  # KeyboardInterrupt
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
