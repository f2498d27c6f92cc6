"""PDEngine with its cores as Ray actors on a local two-node cluster (one CPU per node, so the
prefill core and the decode core land on different nodes) and the KV pulled over TCP: the tokens of
one colocated engine, the transfer really used, and aborts during the prefill and the decode leave
both pools whole and nothing held by the prefill core's server. Ray cores without the TCP transport
are refused."""
from __future__ import annotations

import asyncio
import random
import time

import msgspec
import pytest
from test_pd_engine import idle

from asyncengine import AsyncLLMEngine, EngineConfig, SamplingParams
from asyncengine.errors import ConfigError

HANG_GUARD_S = 240.0  # only a guard against a hang


def cfg(model_dir: str, tmp_path, **kw) -> EngineConfig:
    return EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=8, num_threads=1,
                        freeze_gc_after_load=False, distributed_timeout_s=60.0, kv_transfer_dir=str(tmp_path), **kw)


def test_ray_cores_need_the_tcp_transport(tiny_llama_dir):
    with pytest.raises(ConfigError, match="kv_transfer_transport='tcp'"):
        EngineConfig(model=tiny_llama_dir, prefill_cores=1, decode_cores=1, distributed_executor_backend="ray")


def test_pd_on_ray_over_tcp(ray_cluster, tiny_llama_dir, tmp_path):
    import ray

    rng = random.Random(4)
    ps = [[rng.randrange(3, 500) for _ in range(rng.randrange(12, 50))] for _ in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def collect(eng, p, rid):
        return [t async for o in eng.generate({"prompt_token_ids": p}, params, request_id=rid)
                for t in o.token_ids_delta]

    async def main():
        async with AsyncLLMEngine(cfg(tiny_llama_dir, tmp_path)) as colo:
            want = [await collect(colo, p, f"r{i}") for i, p in enumerate(ps)]
        pd = AsyncLLMEngine.from_config(cfg(tiny_llama_dir, tmp_path, prefill_cores=1, decode_cores=1,
                          distributed_executor_backend="ray", kv_transfer_transport="tcp"))
        nodes = {e.client.clients[0].node_id for e in pd.engines}
        assert nodes == {n["NodeID"] for n in ray.nodes() if n["Alive"]}  # one core on each node
        async with pd:
            got = await asyncio.wait_for(asyncio.gather(*(collect(pd, p, f"r{i}") for i, p in enumerate(ps))),
                                         HANG_GUARD_S)
            assert got == want
            long = msgspec.structs.replace(params, max_tokens=200)
            stream = pd.generate({"prompt_token_ids": ps[0]}, long, request_id="x")  # aborted in its prefill
            await pd.abort("x")
            assert [o async for o in stream][-1].outputs[0].finish_reason == "abort"
            stream = pd.generate({"prompt_token_ids": ps[1]}, long, request_id="y")  # and in its decode
            await asyncio.wait_for(stream.__anext__(), HANG_GUARD_S)
            await stream.aclose()
            s = await idle(pd)
            assert s["transfer_files"] == 0 and s["num_streams"] == 0
            assert all(c["num_free_kv_blocks"] == c["num_kv_blocks"] for c in s["cores"]), s["cores"]
            [d] = s["decode"]
            assert d["kv_transfer_imported_requests"] >= len(ps) and d["kv_transfer_rejected_files"] == 0

    asyncio.run(main())
    for _ in range(int(HANG_GUARD_S / 0.1)):  # Ray returns the cores' CPUs asynchronously
        if ray.available_resources().get("CPU", 0) == 2:
            break
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 2  # both cores gave their CPU back
