"""The offload connector behind the real front ends: the async engine's overlapped busy loop (a
request waiting for a disk read must not stall or spin it, an abort mid-read must leave nothing
held) and the multiprocess executor (the step messages cross a pipe)."""
from __future__ import annotations

import asyncio
import random

import pytest

from asyncengine import AsyncLLMEngine, EngineConfig, SamplingParams
from asyncengine.engine_core.core import EngineCore
from asyncengine.core.request import Request

HANG_GUARD_S = 120.0  # only a guard against a hang, never what a test checks
VOCAB = 512


def prompts(seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(48)]
    return [system + [rng.randrange(3, VOCAB) for _ in range(4 + i)] for i in range(3)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def answers(eng: AsyncLLMEngine, ps: list[list[int]]) -> list[list[int]]:
    out = []
    for i, p in enumerate(ps):  # one after another: the later ones hit what the first computed
        toks: list[int] = []
        async for o in eng.generate({"prompt_token_ids": p}, greedy(6), request_id=f"r{i}"):
            toks.extend(o.token_ids_delta)
        out.append(toks)
    return out


def test_async_engine_restart_hits_disk_and_aborts_clean(tiny_llama_dir, tmp_path):
    def engine(**kw):
        return AsyncLLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64,
                                           block_size=8, **kw))

    async def main():
        async with engine() as eng:
            want = await asyncio.wait_for(answers(eng, prompts()), HANG_GUARD_S)
        async with engine(kv_offload_dir=str(tmp_path)) as eng:
            assert await asyncio.wait_for(answers(eng, prompts()), HANG_GUARD_S) == want
        async with engine(kv_offload_dir=str(tmp_path)) as eng:  # a restart
            assert await asyncio.wait_for(answers(eng, prompts()), HANG_GUARD_S) == want
            s = eng.stats()
            assert s["kv_offload_disk_hit_tokens"] >= 48
            # an abort soon after arrival (often while it waits for its disk read)
            eng.generate({"prompt_token_ids": prompts(seed=6)[0] + prompts()[0]}, greedy(6), request_id="gone")
            await asyncio.sleep(0)
            await eng.abort("gone")
            for _ in range(500):  # a read in flight finishes in the background; then nothing is held
                s = eng.stats()
                if s["kv_offload_pending_stages"] == 0 and s["num_waiting"] + s["num_running"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert s["kv_offload_pending_stages"] == 0 and s["kv_offload_pinned_slots"] == 0
            assert s["num_free_kv_blocks"] == s["num_kv_blocks"]

    asyncio.run(main())


def test_multiprocess_executor_token_exact(tiny_llama_dir, tmp_path):
    """The worker in another process: metadata and reports are msgspec-encoded across the pipe."""
    def run(**kw) -> list[list[int]]:
        core = EngineCore(EngineConfig(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8,
                                       distributed_executor_backend="mp", **kw))
        try:
            outs = []
            for i, p in enumerate(prompts()):
                core.add_request(Request(request_id=f"m{i}", prompt_token_ids=p, max_tokens=6,
                                         sampling_params=greedy(6)))
                toks: list[int] = []
                while core.has_unfinished():
                    for o in core.step():
                        toks.extend(o.new_token_ids)
                outs.append(toks)
            return outs, core.stats()
        finally:
            core.shutdown()

    want, _ = run()
    assert run(kv_offload_dir=str(tmp_path))[0] == want
    got, s = run(kv_offload_dir=str(tmp_path))
    assert got == want
    assert s["kv_offload_disk_hit_tokens"] >= 48


def test_cli_flags_reach_the_config(tmp_path):
    from asyncengine.cli.args import build_parser
    from asyncengine.cli.chat import _config

    args = build_parser().parse_args(["chat", "some-model", "--kv-offload-memory", "64MiB",
                                      "--kv-offload-dir", str(tmp_path)])
    cfg = _config(args)
    assert (cfg.kv_offload_bytes, cfg.kv_offload_dir) == (64 << 20, str(tmp_path))
    assert _config(build_parser().parse_args(["chat"])).kv_offload_dir is None
