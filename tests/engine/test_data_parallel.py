"""Data parallelism: ``data_parallel_size`` engine cores, each in its own process with its own
busy loop, scheduler, KV cache and executor, behind one AsyncLLMEngine that routes each request
to the least loaded core. Parity with transformers (DP=2, and DP=2 x TP=2 on the 2-layer tiny
llama with one thread per worker), routing (least loaded, or the core holding the prompt's prefix),
abort reaching the owning core, stats aggregated per core, a killed core failing its own streams
(the other core's complete), the last one failing the engine, and no process left behind."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from asyncengine import AsyncLLMEngine, EngineConfig, EngineDeadError, SamplingParams
from model_utils import compare
from proc_utils import descendants, drain_after_core_death

HANG_GUARD_S = 240.0


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def dp_engine(model_dir: str, dp: int, tp: int = 1) -> AsyncLLMEngine:
    return AsyncLLMEngine(EngineConfig(model=model_dir, dtype="float32", data_parallel_size=dp,
                                       tensor_parallel_size=tp, num_threads=1, max_num_seqs=8,
                                       max_num_batched_tokens=48, num_kv_blocks=32, freeze_gc_after_load=False))


async def run_all(eng, requests):
    async def one(i, ids, n):
        return await eng.complete({"prompt_token_ids": ids}, greedy(n), request_id=f"r{i}")
    return await asyncio.wait_for(asyncio.gather(*(one(i, ids, n) for i, (ids, n) in enumerate(requests))),
                                  HANG_GUARD_S)


async def settle(eng):
    for _ in range(500):
        s = eng.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and all(
                c.get("num_free_kv_blocks") == c.get("num_kv_blocks") for c in s["cores"]):
            return s
        await asyncio.sleep(0.02)
    raise AssertionError(f"the cores never went idle: {eng.stats()}")


async def test_dp2_parity_routing_abort_stats(tiny_llama_dir, tiny_reference):
    requests, refs = tiny_reference("llama")
    eng = dp_engine(tiny_llama_dir, 2)
    pids = [c.proc.pid for c in eng.client.clients]
    async with eng:
        outs = await run_all(eng, requests)
        c = compare([o.outputs[0].token_ids for o in outs], refs)
        print(f"[dp] DP=2 vs transformers {c}")
        assert c["exact"] + c["near_tie"] == len(requests)
        s = await settle(eng)
        # both cores served, each with its own scheduler and KV cache; the totals add up
        steps = [core["num_steps"] for core in s["cores"]]
        assert len(steps) == 2 and all(n > 0 for n in steps), steps
        assert s["num_steps"] == sum(steps) and s["num_kv_blocks"] == 64
        assert s["total_output_tokens"] == sum(n for _, n in requests)

        # aborts reach the core that owns the request: a long stream on each core, cancelled
        streams = [eng.generate({"prompt_token_ids": [9 + i, 8, 7]}, greedy(400), request_id=f"long{i}")
                   for i in range(2)]
        for _ in range(500):  # the busy loop sends them at its next turn
            if all(f"long{i}" in eng.client.owner for i in range(2)):
                break
            await asyncio.sleep(0.01)
        assert sorted(eng.client.owner[f"long{i}"] for i in range(2)) == [0, 1]  # least loaded: one each
        for st in streams:
            async for _ in st:
                break
            await st.aclose()
        s = await settle(eng)  # both cores freed the cancelled requests' blocks
        assert all(core["num_running"] == 0 for core in s["cores"])
        assert eng.client.owner == {}

        # prefix affinity: a prompt that shares three full blocks with an earlier one goes to the
        # core that served it, although the other core is idler, and hits its prefix cache there
        shared = list(range(200, 248))  # 3 blocks of 16 tokens
        await asyncio.wait_for(eng.complete({"prompt_token_ids": shared + [5, 6]}, greedy(2), request_id="pa"),
                               HANG_GUARD_S)
        s = await settle(eng)
        hits0 = [core["prefix_cache_hits"] for core in s["cores"]]
        busy = eng.generate({"prompt_token_ids": [3, 4, 5]}, greedy(400), request_id="busy")
        async for _ in busy:  # it runs on core 0 (both idle: the lowest index), as "pa" did
            break
        assert eng.client.owner["busy"] == 0
        # least-loaded routing would send this one to core 1
        await asyncio.wait_for(eng.complete({"prompt_token_ids": shared + [7, 8]}, greedy(2), request_id="pb"),
                               HANG_GUARD_S)
        await busy.aclose()
        s = await settle(eng)  # (a core emptied by an abort reports its final load and stats too)
        assert s["dp_prefix_affinity_routed"] == 1
        assert s["cores"][0]["prefix_cache_hits"] - hits0[0] >= 48 and s["cores"][1]["prefix_cache_hits"] == hits0[1]
    for c in eng.client.clients:
        c.proc.join(30)
    assert not any(c.proc.is_alive() for c in eng.client.clients), pids


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def test_dp2_x_tp2_correctness_and_a_killed_core(tiny_llama_dir, tiny_reference):
    """Two engine cores, each with two tensor-parallel worker processes (one thread each): parity.
    Then one core process is SIGKILLed mid-run: its streams fail with EngineCoreDied, the other
    core's complete; the last one killed, the engine is dead (EngineDeadError), and no process is
    left, not the cores nor any worker of either."""
    from proc_utils import wait_gone

    requests, refs = tiny_reference("llama")
    requests, refs = requests[:10], refs[:10]
    eng = dp_engine(tiny_llama_dir, 2, tp=2)
    async with eng:
        outs = await run_all(eng, requests)
        s = await settle(eng)
        c = compare([o.outputs[0].token_ids for o in outs], refs)
        print(f"[dp] DP=2 x TP=2 vs transformers {c}")
        assert c["exact"] + c["near_tie"] == len(requests)
        assert all(core["num_steps"] > 0 for core in s["cores"])

        cores = [cl.proc.pid for cl in eng.client.clients]
        pids = set(cores) | {w for p in cores for w in descendants(p)}
        assert len(pids) >= 6, pids  # two cores, two workers each
        streams = [eng.generate({"prompt_token_ids": [5 + i, 6, 7]}, greedy(200)) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(st.__anext__() for st in streams)), HANG_GUARD_S)
        on = [eng.client.owner[st.request_id] for st in streams]
        assert set(on) == {0, 1}, on

        os.kill(cores[1], signal.SIGKILL)
        await asyncio.wait_for(drain_after_core_death(streams, on, dead=1, num_tokens=200), HANG_GUARD_S)
        assert eng.cores_alive() == (1, 2) and not eng.errored
        out = [o async for o in eng.generate({"prompt_token_ids": [9, 9, 9]}, greedy(4))][-1]
        assert len(out.outputs[0].token_ids) == 4  # served by the core left
        os.kill(cores[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_drain(eng.generate({"prompt_token_ids": [5, 6, 7]}, greedy(400))), HANG_GUARD_S)
    wait_gone(pids, timeout=60.0)


async def test_engine_core_process_parity_abort_and_cleanup(tiny_llama_dir, tiny_reference):
    """engine_core_process=True: the one engine core runs in its own process (the model step never
    waits on the front end's Python for the GIL); same tokens as transformers, aborts reach it, its
    blocks come back, and shutdown leaves no process behind."""
    requests, refs = tiny_reference("llama")
    requests, refs = requests[:8], refs[:8]
    eng = AsyncLLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", engine_core_process=True,
                                      max_num_seqs=8, max_num_batched_tokens=48, num_kv_blocks=32,
                                      freeze_gc_after_load=False))
    assert len(eng.client.clients) == 1
    proc = eng.client.clients[0].proc
    assert proc.pid != os.getpid() and proc.is_alive()
    async with eng:
        outs = await run_all(eng, requests)
        c = compare([o.outputs[0].token_ids for o in outs], refs)
        assert c["exact"] + c["near_tie"] == len(requests), c
        stream = eng.generate({"prompt_token_ids": [9, 8, 7]}, greedy(400), request_id="long")
        async for _ in stream:
            break
        await stream.aclose()
        s = await settle(eng)
        assert s["num_kv_blocks"] == 32 and s["total_output_tokens"] < sum(n for _, n in requests) + 400
    proc.join(30)
    assert not proc.is_alive()


def test_core_start_errors_keep_their_type(tiny_llama_dir, tmp_path):
    """A config the core refuses (a KV cache too small for 2 blocks) is the caller's ConfigError, as
    in-process; a model the front end cannot read fails before the core finishes importing, and no
    core is left."""
    import multiprocessing

    from asyncengine.errors import ConfigError, ModelLoadError

    with pytest.raises(ConfigError, match="fewer than 2 blocks"):
        AsyncLLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", kv_cache_bytes=1, engine_core_process=True))
    with pytest.raises(ModelLoadError):
        AsyncLLMEngine(EngineConfig(model=str(tmp_path / "missing.gguf"), engine_core_process=True))
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("asyncengine-core")]


def test_llm_refuses_engine_core_process(tiny_llama_dir):
    from asyncengine import LLM
    from asyncengine.errors import ConfigError

    with pytest.raises(ConfigError, match="engine_core_process"):
        LLM(tiny_llama_dir, dtype="float32", engine_core_process=True)
