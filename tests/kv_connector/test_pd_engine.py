"""PDEngine: one prefill core and one decode core, each a process, against one colocated engine:
the same tokens, the transfer really used, aborts leave both cores' pools whole and no file, a
killed core fails its request promptly with EngineDeadError."""
from __future__ import annotations

import dataclasses

import asyncio
import os
import random
import signal

import pytest

from asyncengine import AsyncLLMEngine, EngineConfig, EngineDeadError, SamplingParams
from asyncengine.engine.pd_client import PDEngine
from asyncengine.errors import ConfigError
from model_utils import assert_stages_in_order

HANG_GUARD_S = 180.0  # only a guard against a hang
VOCAB = 512


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompts(k: int = 4) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(12, 50))] for _ in range(k)]


async def collect(eng, p, rid, n=6):
    toks = []
    async for o in eng.generate({"prompt_token_ids": p}, greedy(n), request_id=rid):
        toks.extend(o.token_ids_delta)
    assert_stages_in_order(o.metrics)  # P/D: arrived and first scheduled on the prefill core
    return toks


def cfg(model_dir, tmp_path, **kw):
    return EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=8,
                        kv_transfer_dir=str(tmp_path), **kw)


def test_pd_engine_matches_colocated_and_cleans_up(tiny_llama_dir, tmp_path):
    async def main():
        async with AsyncLLMEngine(cfg(tiny_llama_dir, tmp_path)) as colo:
            want = await asyncio.wait_for(asyncio.gather(*(collect(colo, p, f"r{i}") for i, p in enumerate(prompts()))),
                                          HANG_GUARD_S)
        async with AsyncLLMEngine.from_config(cfg(tiny_llama_dir, tmp_path, prefill_cores=1, decode_cores=1)) as pd:
            got = await asyncio.wait_for(asyncio.gather(*(collect(pd, p, f"r{i}") for i, p in enumerate(prompts()))),
                                         HANG_GUARD_S)
            assert got == want
            s = pd.stats()
            assert s["decode"][0]["kv_transfer_imported_requests"] == 4
            assert s["prefill"][0]["kv_transfer_exported_requests"] == 4
            # aborts: one right away, one after its first tokens
            stream = pd.generate({"prompt_token_ids": prompts()[0]}, greedy(200), request_id="x")
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await stream.aclose()
            stream = pd.generate({"prompt_token_ids": prompts()[1]}, greedy(200), request_id="y")
            await asyncio.wait_for(stream.__anext__(), HANG_GUARD_S)
            await stream.aclose()
            for _ in range(500):
                s = pd.stats()
                cores = s["prefill"] + s["decode"]
                if all(c["num_running"] + c["num_waiting"] == 0 and c["num_free_kv_blocks"] == c["num_kv_blocks"]
                       for c in cores) and s["transfer_files"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert all(c["num_free_kv_blocks"] == c["num_kv_blocks"] for c in cores), cores
            assert s["transfer_files"] == 0
        assert not os.listdir(tmp_path)  # the front end's transfer folder is gone

    asyncio.run(main())


def test_short_prompts_skip_the_hop(tiny_llama_dir, tmp_path):
    async def main():
        async with AsyncLLMEngine(cfg(tiny_llama_dir, tmp_path)) as colo:
            want = [await collect(colo, p, f"r{i}") for i, p in enumerate(prompts())]
        config = cfg(tiny_llama_dir, tmp_path, prefill_cores=1, decode_cores=1)
        cut = sorted(len(p) for p in prompts())[2]  # the two shortest skip
        async with AsyncLLMEngine.from_config(dataclasses.replace(config, pd_skip_hop_below=cut)) as pd:
            got = [await asyncio.wait_for(collect(pd, p, f"r{i}"), HANG_GUARD_S) for i, p in enumerate(prompts())]
            s = pd.stats()
        assert got == want
        assert s["num_skipped_hops"] == 2 and s["prefill"][0]["kv_transfer_exported_requests"] == 2
        assert s["decode"][0]["kv_transfer_imported_requests"] == 2 and s["decode"][0]["kv_transfer_misses"] == 2

    asyncio.run(main())


def test_speculation_on_the_decode_core(tiny_llama_dir, tmp_path):
    """A draft model (the target itself: every draft right) on the decode core, none on the
    prefill core: the colocated engine's tokens, and the draft's own KV covers the imported prompt
    (all drafts accepted)."""
    spec = {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3}

    async def main():
        async with AsyncLLMEngine(cfg(tiny_llama_dir, tmp_path)) as colo:
            want = [await collect(colo, p, f"r{i}", 12) for i, p in enumerate(prompts())]
        async with AsyncLLMEngine.from_config(cfg(tiny_llama_dir, tmp_path, prefill_cores=1, decode_cores=1,
                                            speculative_config=spec)) as pd:
            got = [await asyncio.wait_for(collect(pd, p, f"r{i}", 12), HANG_GUARD_S) for i, p in enumerate(prompts())]
            s = pd.stats()
        assert got == want
        d, p = s["decode"][0], s["prefill"][0]
        assert d["kv_transfer_imported_requests"] == 4 and p["kv_transfer_exported_requests"] == 4
        assert d["spec_num_draft_tokens"] > 0 and d["spec_acceptance_rate"] == 1.0, d
        assert p.get("spec_num_draft_tokens", 0) == 0

    asyncio.run(main())


def test_a_killed_decode_core_fails_its_request(tiny_llama_dir, tmp_path):
    async def main():
        async with AsyncLLMEngine.from_config(cfg(tiny_llama_dir, tmp_path, prefill_cores=1, decode_cores=1)) as pd:
            stream = pd.generate({"prompt_token_ids": prompts()[0]}, greedy(400), request_id="k")
            await asyncio.wait_for(stream.__anext__(), HANG_GUARD_S)
            os.kill(pd.decode[0].client.clients[0].proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async def rest():
                    async for _ in stream:
                        pass
                await asyncio.wait_for(rest(), HANG_GUARD_S)

    asyncio.run(main())


def test_config_needs_both_sides():
    with pytest.raises(ConfigError, match="prefill_cores"):
        EngineConfig(prefill_cores=1)


def test_folders_of_dead_front_ends_are_removed(tmp_path):
    from asyncengine.engine.pd_client import _remove_dead_folders

    dead = tmp_path / "pd-999999999-abc"
    live = tmp_path / f"pd-{os.getpid()}-def"
    other = tmp_path / "unrelated"
    for d in (dead, live, other):
        d.mkdir()
        (d / "x.kv").write_bytes(b"1")
    _remove_dead_folders(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, other.name])


def free(core_stats: dict) -> int:
    """A core's free blocks; a core that has not reported yet (never stepped) has them all."""
    return core_stats.get("num_free_kv_blocks", core_stats["num_kv_blocks"])


async def idle(pd: PDEngine) -> dict:
    """pd.stats() once no request runs, every pool is whole and no file is left (bounded wait)."""
    for _ in range(int(HANG_GUARD_S / 0.02)):
        s = pd.stats()
        if s["num_streams"] == 0 and s["transfer_files"] == 0 and all(
                c["num_running"] + c["num_waiting"] == 0 and free(c) == c["num_kv_blocks"]
                for c in s["cores"]):
            break
        await asyncio.sleep(0.02)
    return s


def test_abort_in_every_phase_and_errors_at_once(tiny_llama_dir, tmp_path):
    """pd.abort while queued for the prefill, and once the prefill core is done but before the
    decode core is asked: the stream ends with "abort", no token, nothing held; a bad request raises
    at generate(), as one engine's does."""
    from asyncengine import InvalidRequestError

    async def main():
        async with AsyncLLMEngine.from_config(cfg(tiny_llama_dir, tmp_path, prefill_cores=1, decode_cores=1)) as pd:
            async def drain(stream):
                return [o async for o in stream]

            stream = pd.generate({"prompt_token_ids": prompts()[0]}, greedy(50), request_id="a")
            assert stream.phase == "prefill"
            await pd.abort("a")
            outs = await asyncio.wait_for(drain(stream), HANG_GUARD_S)
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
            exported = (await idle(pd))["prefill"][0].get("kv_transfer_exported_requests", 0)

            stream = pd.generate({"prompt_token_ids": prompts()[1]}, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, n=2),
                                 request_id="b")
            for _ in range(int(HANG_GUARD_S / 0.02)):  # the prefill core exports it; nobody reads the stream
                if pd.stats()["prefill"][0].get("kv_transfer_exported_requests", 0) > exported:
                    break
                await asyncio.sleep(0.02)
            await pd.abort("b")
            outs = await asyncio.wait_for(drain(stream), HANG_GUARD_S)
            assert len(outs) == 1 and outs[0].finished
            assert [(c.index, c.finish_reason, c.token_ids) for c in outs[0].outputs] == [(0, "abort", []),
                                                                                          (1, "abort", [])]
            s = await idle(pd)
            assert s["transfer_files"] == 0 and s["num_streams"] == 0
            assert s["decode"][0].get("kv_transfer_imported_requests", 0) == 0
            assert all(free(c) == c["num_kv_blocks"] for c in s["cores"])

            live = pd.generate({"prompt_token_ids": prompts()[2]}, greedy(4), request_id="c")
            with pytest.raises(InvalidRequestError, match="already in use"):
                pd.generate({"prompt_token_ids": prompts()[2]}, greedy(4), request_id="c")
            with pytest.raises(InvalidRequestError):
                pd.generate({"prompt_token_ids": [5] * 5000}, greedy(4), request_id="d")
            assert len(await asyncio.wait_for(drain(live), HANG_GUARD_S)) >= 1
            assert (await idle(pd))["num_streams"] == 0

    asyncio.run(main())
