"""The ``ray`` executor on a local two-node Ray cluster (one ``ray.cluster_utils.Cluster`` per test
session: no dashboard, one CPU per node, a small object store): TP=2 with one rank on each node
(STRICT_SPREAD bundles), greedy token-exact against transformers and TP=1; a lost actor kills
the engine; and a clear error where Ray is missing."""
from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest
from model_utils import compare
from proc_utils import drain_after_core_death

from asyncengine import AsyncLLMEngine, EngineConfig, EngineDeadError, SamplingParams
from asyncengine.errors import ConfigError

HANG_GUARD_S = 240.0


async def exact_vs_transformers(eng: AsyncLLMEngine, requests, refs, label: str) -> None:
    """Greedy, all at once: every request token-exact with transformers (or first diverging at a near tie)."""
    outs = await asyncio.wait_for(asyncio.gather(*(
        eng.complete({"prompt_token_ids": ids}, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        for ids, n in requests)), HANG_GUARD_S)
    c = compare([o.outputs[0].token_ids for o in outs], refs)
    print(f"[ray] {label} vs transformers {c}")
    assert c["exact"] + c["near_tie"] == len(requests)


def ray_engine(model_dir: str, **kw) -> AsyncLLMEngine:
    return AsyncLLMEngine(EngineConfig(model=model_dir, dtype="float32", tensor_parallel_size=2,
                                       distributed_executor_backend="ray", ray_placement_strategy="STRICT_SPREAD",
                                       num_threads=1, max_num_seqs=8, max_num_batched_tokens=48, num_kv_blocks=32,
                                       freeze_gc_after_load=False, distributed_timeout_s=60.0, **kw))


async def test_tp2_one_rank_per_node(ray_cluster, tiny_llama_dir, tiny_reference):
    import ray

    requests, refs = tiny_reference("llama")
    requests, refs = requests[:10], refs[:10]
    eng = ray_engine(tiny_llama_dir)
    ex = eng.core.executor
    assert len(set(ex.node_ids)) == 2  # one rank on each node
    assert set(ex.node_ids) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    async with eng:
        await exact_vs_transformers(eng, requests, refs, "TP=2 over two nodes")
        stats = eng.core.collective_rpc("runner_stats")
        assert [s["rank"] for s in stats] == [0, 1]

        # an actor lost mid-run: every stream fails with EngineDeadError, nobody hangs
        streams = [eng.generate({"prompt_token_ids": [5 + i, 6, 7]},
                                SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)) for i in range(4)]

        async def consume(s):
            with pytest.raises(EngineDeadError):
                async for _ in s:
                    pass
        first = [asyncio.ensure_future(s.__anext__()) for s in streams[:1]]
        await asyncio.wait_for(asyncio.gather(*first), HANG_GUARD_S)
        ray.kill(ex.actors[1])
        await asyncio.wait_for(asyncio.gather(*(consume(s) for s in streams)), HANG_GUARD_S)
    # the placement group is released for the next engine
    from ray.util.placement_group import placement_group_table

    assert placement_group_table(ex.pg)["state"] == "REMOVED"


async def test_dp2_cores_one_per_node(ray_cluster, tiny_llama_dir, tiny_reference):
    """Data-parallel replicas on Ray: two engine cores as actors, one on each node (STRICT_SPREAD),
    behind one front end: token-exact, both serve, stats per core; a lost core actor fails only its
    own streams (EngineCoreDied); shutdown gives the cluster its CPUs back."""
    import ray

    requests, refs = tiny_reference("llama")
    requests, refs = requests[:8], refs[:8]
    eng = AsyncLLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", data_parallel_size=2,
                                      distributed_executor_backend="ray", ray_placement_strategy="STRICT_SPREAD",
                                      num_threads=1, max_num_seqs=8, max_num_batched_tokens=48, num_kv_blocks=32,
                                      freeze_gc_after_load=False, distributed_timeout_s=60.0))
    clients = eng.client.clients
    assert {c.node_id for c in clients} == {n["NodeID"] for n in ray.nodes() if n["Alive"]}  # one per node
    assert ray.available_resources().get("CPU", 0) == 0  # each core holds its node's one CPU
    async with eng:
        await exact_vs_transformers(eng, requests, refs, "DP=2 core actors over two nodes")
        for _ in range(500):  # the cores' last reports arrive after the last outputs
            s = eng.stats()
            if s["num_running"] == 0 and s["total_output_tokens"] == sum(n for _, n in requests):
                break
            await asyncio.sleep(0.02)
        assert s["data_parallel_size"] == 2 and all(core["num_steps"] > 0 for core in s["cores"]), s

        # a core actor lost mid-run: its streams fail with EngineCoreDied, the other core's complete
        # (data parallel degrades: engine/dp_health.py), nobody hangs
        streams = [eng.generate({"prompt_token_ids": [5 + i, 6, 7]},
                                SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(st.__anext__() for st in streams)), HANG_GUARD_S)
        on = [eng.client.owner[st.request_id] for st in streams]

        clients[1].proc.kill()
        await asyncio.wait_for(drain_after_core_death(streams, on, dead=1, num_tokens=300), HANG_GUARD_S)
        assert 1 in on and eng.client.cores_alive() == (1, 2) and not eng.errored
    for _ in range(300):  # both cores' CPUs are free again (actors ended, placement group removed)
        if ray.available_resources().get("CPU", 0) == 2:
            break
        await asyncio.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 2, ray.available_resources()


async def test_pp2_one_stage_per_node(ray_cluster, tiny_llama_dir, tiny_reference):
    """Pipeline parallel on Ray: two stages, one actor on each node; token-exact; a stage actor lost
    mid-stream fails every stream with EngineDeadError."""
    import ray

    requests, refs = tiny_reference("llama")
    requests, refs = requests[:8], refs[:8]
    eng = AsyncLLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", pipeline_parallel_size=2,
                                      distributed_executor_backend="ray", ray_placement_strategy="STRICT_SPREAD",
                                      num_threads=1, max_num_seqs=8, max_num_batched_tokens=48, num_kv_blocks=32,
                                      freeze_gc_after_load=False, distributed_timeout_s=60.0))
    ex = eng.core.executor
    assert len(set(ex.node_ids)) == 2 and eng.core.batch_queue_size == 2
    async with eng:
        await exact_vs_transformers(eng, requests, refs, "PP=2 over two nodes")
        assert [s["pp_rank"] for s in eng.core.collective_rpc("runner_stats")] == [0, 1]
        streams = [eng.generate({"prompt_token_ids": [5 + i, 6, 7]},
                                SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)) for i in range(4)]

        async def consume(s):
            with pytest.raises(EngineDeadError):
                async for _ in s:
                    pass
        await asyncio.wait_for(streams[0].__anext__(), HANG_GUARD_S)
        ray.kill(ex.actors[1])
        await asyncio.wait_for(asyncio.gather(*(consume(s) for s in streams)), HANG_GUARD_S)


RAY_CLEANUP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from asyncengine import LLM, SamplingParams
    if __name__ == "__main__":
        import ray
        llm = LLM(sys.argv[1], dtype="float32", distributed_executor_backend="ray", pipeline_parallel_size=2,
                  num_kv_blocks=32, num_threads=1)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        started = ray.is_initialized()
        llm.shutdown()
        print(json.dumps({"tokens": out[0].outputs[0].token_ids, "started": started,
                          "connected": ray.is_initialized()}), flush=True)
""")


def test_engine_stops_the_ray_cluster_it_started(tiny_llama_dir, tmp_path):
    """An engine that had to start a local Ray cluster (no RAY_ADDRESS, no connection) stops it at
    shutdown: no Ray process is left below the app's process."""
    import json
    import os
    import subprocess

    from proc_utils import descendants

    script = tmp_path / "ray_cleanup.py"
    script.write_text(RAY_CLEANUP_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, str(script), tiny_llama_dir], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # after shutdown, before the interpreter exits
        left = descendants(proc.pid)
        report = json.loads(line)
        assert report["started"] and not report["connected"], report
        assert len(report["tokens"]) == 4
        assert not left, f"processes left below the app after shutdown: {left}"
    finally:
        proc.wait(60)


def test_clear_error_without_ray(tiny_llama_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    from asyncengine.engine_core.core import EngineCore

    with pytest.raises(ConfigError, match=r"pip install 'asyncengine\[ray\]'"):
        EngineCore(EngineConfig(model=tiny_llama_dir, dtype="float32", tensor_parallel_size=2,
                                distributed_executor_backend="ray"))
