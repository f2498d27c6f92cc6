"""The ``ray`` executor on a local two-node Ray cluster (one ``ray.cluster_utils.Cluster`` per test
session: no dashboard, one CPU per node, a small object store): TP=2 with one rank on each node
(STRICT_SPREAD bundles), greedy token-exact against transformers and TP=1; a lost actor kills
the engine; and a clear error where Ray is missing."""
from __future__ import annotations

import asyncio
import sys

import pytest

from asyncengine import AsyncLLMEngine, EngineConfig, EngineDeadError, SamplingParams
from asyncengine.errors import ConfigError
from model_utils import compare

HANG_GUARD_S = 240.0


@pytest.fixture(scope="session")
def ray_cluster():
    import ray  # the [ray] extra (part of [dev])
    from ray.cluster_utils import Cluster

    node = dict(num_cpus=1, object_store_memory=80 * 1024 * 1024, include_dashboard=False)
    cluster = Cluster(initialize_head=True, head_node_args=node)
    cluster.add_node(**{k: v for k, v in node.items() if k != "include_dashboard"})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


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
        outs = await asyncio.wait_for(asyncio.gather(*(
            eng.complete({"prompt_token_ids": ids}, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for ids, n in requests)), HANG_GUARD_S)
        c = compare([o.outputs[0].token_ids for o in outs], refs)
        print(f"[ray] TP=2 over two nodes vs transformers {c}")
        assert c["exact"] + c["near_tie"] == len(requests)
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


def test_clear_error_without_ray(tiny_llama_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    from asyncengine.core.engine_core import EngineCore

    with pytest.raises(ConfigError, match=r"pip install 'asyncengine\[ray\]'"):
        EngineCore(EngineConfig(model=tiny_llama_dir, dtype="float32", tensor_parallel_size=2,
                                distributed_executor_backend="ray"))
