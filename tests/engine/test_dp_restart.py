"""``restart_dead_cores``: a killed data-parallel core fails only its own streams, a fresh core
process takes its place while the other serves, and then both cores serve again."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from asyncengine import AsyncLLMEngine, EngineConfig, EngineCoreDied, SamplingParams
from model_utils import compare

HANG_GUARD_S = 120.0


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def last(stream):
    out = None
    async for out in stream:
        pass
    return out


async def test_a_dead_core_is_replaced(tiny_llama_dir, hf_reference):
    eng = AsyncLLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", data_parallel_size=2,
                                      restart_dead_cores=True, num_threads=1, num_kv_blocks=64,
                                      max_model_len=512, freeze_gc_after_load=False))
    async with eng:
        old = eng.client.clients[1].proc.pid
        streams = [eng.generate({"prompt_token_ids": [5 + i, 6, 7]}, greedy(300)) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*(s.__anext__() for s in streams)), HANG_GUARD_S)
        on = [eng.client.owner[s.request_id] for s in streams]
        assert sorted(on) == [0, 1]
        os.kill(old, signal.SIGKILL)
        victim, survivor = (streams[0], streams[1]) if on[0] == 1 else (streams[1], streams[0])
        with pytest.raises(EngineCoreDied):
            await asyncio.wait_for(last(victim), HANG_GUARD_S)
        assert len((await asyncio.wait_for(last(survivor), HANG_GUARD_S)).outputs[0].token_ids) == 300
        for _ in range(int(HANG_GUARD_S / 0.1)):  # bounded: the new core loads the model
            if eng.client.health.num_alive == 2:
                break
            await asyncio.sleep(0.1)
        assert eng.client.health.summary()["restarts"] == 1 and eng.client.health.num_alive == 2
        assert eng.client.clients[1].proc.pid != old and eng.client.clients[1].proc.is_alive()
        after = [([9, 3 + i, 9], 4) for i in range(6)]  # no id 0-2: the reference masks its pad id
        outs = await asyncio.wait_for(asyncio.gather(*(last(eng.generate({"prompt_token_ids": p}, greedy(m)))
                                                       for p, m in after)), HANG_GUARD_S)
        # the new core's (and the survivor's) tokens are transformers' (fp32, greedy; near-ties excused)
        compare([o.outputs[0].token_ids for o in outs], hf_reference(tiny_llama_dir, after))
        assert eng.client.stats()["cores"][1]["num_steps"] > 0  # the new core served some of them
    assert not eng.client.clients[1].proc.is_alive()
