"""Apps on trio through anyio (asyncengine/engine/anyio_bridge.py): streaming, cancellation that
aborts the request and frees its KV blocks, many concurrent requests, errors, on anyio's trio
backend (and once on its asyncio backend). fp32, greedy, EOS ignored, tiny random model; waits are
bounded loops of short sleeps, never a time limit on what is checked."""
from __future__ import annotations

import gc
import random

import anyio
import pytest

from asyncengine import EngineConfig, InvalidRequestError, OutputKind, SamplingParams
from asyncengine.engine.anyio_bridge import AnyioEngine

VOCAB = 512  # the tiny checkpoints of conftest.py


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def bridge(model_dir: str) -> AnyioEngine:
    return AnyioEngine.from_config(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=256,
                                                max_num_seqs=32))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


async def collect(engine: AnyioEngine, prompt, max_tokens: int) -> tuple[list[int], object]:
    ids, last = [], None
    async for out in engine.generate({"prompt_token_ids": prompt}, greedy(max_tokens)):
        ids += out.token_ids_delta
        last = out
    return ids, last


async def settled(engine: AnyioEngine, iterations: int = 2000) -> dict:
    """The engine's stats once nothing runs or waits (a bounded number of short sleeps)."""
    for _ in range(iterations):
        s = await engine.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_streams"] == 0:
            return s
        await anyio.sleep(0.01)
    raise AssertionError(f"the engine never went idle: {s}")


def run_on_trio(fn, *args):
    return anyio.run(fn, *args, backend="trio")


@pytest.fixture(scope="module")
def alone(tiny_llama_dir):
    """Each prompt's greedy tokens when it runs alone (the reference for the concurrent test)."""

    async def main():
        async with bridge(tiny_llama_dir) as engine:
            return [(await collect(engine, p, 12))[0] for p in prompts(24)]

    return run_on_trio(main)


def test_streams_on_trio(tiny_llama_dir):
    async def main():
        import trio

        assert trio.lowlevel.current_trio_token() is not None  # really on trio: no asyncio loop here
        async with bridge(tiny_llama_dir) as engine:
            ids, last = await collect(engine, [5, 6, 7, 8], 10)
            assert len(ids) == 10 and last.finished and last.outputs[0].finish_reason == "length"
            final = await engine.complete({"prompt_token_ids": [5, 6, 7, 8]},
                                          SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                         output_kind=OutputKind.FINAL_ONLY))
            assert final.finished and list(final.outputs[0].token_ids) == ids  # the stream lost nothing
            pieces = [o.text_delta async for o in engine.generate("hello there", greedy(6))]
            assert len(pieces) >= 2 and "".join(pieces)  # text prompts and deltas, one output per step
            s = await settled(engine)
            assert s["num_free_kv_blocks"] == s["num_kv_blocks"]

    run_on_trio(main)


def test_many_concurrent_requests_each_get_their_own_tokens(tiny_llama_dir, alone):
    async def main():
        results: dict[int, list[int]] = {}
        async with bridge(tiny_llama_dir) as engine:
            async def one(i, p):
                results[i] = (await collect(engine, p, 12))[0]

            async with anyio.create_task_group() as tg:
                for i, p in enumerate(prompts(24)):
                    tg.start_soon(one, i, p)
            s = await settled(engine)
            assert s["num_free_kv_blocks"] == s["num_kv_blocks"]
        return results

    results = run_on_trio(main)
    assert [results[i] for i in range(24)] == alone  # no cross-talk, nothing lost, same tokens as alone


def test_cancelling_the_trio_task_aborts_the_request_and_frees_its_blocks(tiny_llama_dir):
    async def main():
        async with bridge(tiny_llama_dir) as engine:
            seen = []
            with anyio.CancelScope() as scope:
                async for out in engine.generate({"prompt_token_ids": prompts(1, seed=3)[0]}, greedy(10_000)):
                    seen.append(out)
                    if len(seen) == 3:
                        scope.cancel()  # the next await in this task raises Cancelled
            assert len(seen) == 3 and not seen[-1].finished
            s = await settled(engine)
            assert s["num_free_kv_blocks"] == s["num_kv_blocks"]
            # the engine goes on serving
            ids, _ = await collect(engine, [9, 10, 11], 4)
            assert len(ids) == 4

    run_on_trio(main)


def test_leaving_early_and_dropping_the_iterator_abort(tiny_llama_dir):
    async def main():
        async with bridge(tiny_llama_dir) as engine:
            async with engine.generate({"prompt_token_ids": [5, 6, 7]}, greedy(10_000)) as stream:
                async for _ in stream:
                    break  # leaving the `async with` closes the stream
            s = await settled(engine)
            assert s["num_free_kv_blocks"] == s["num_kv_blocks"]
            stream = engine.generate({"prompt_token_ids": [5, 6, 7]}, greedy(10_000))
            await stream.__anext__()
            del stream  # dropped: aborted when collected
            gc.collect()
            s = await settled(engine)
            assert s["num_free_kv_blocks"] == s["num_kv_blocks"]

    run_on_trio(main)


def test_a_bad_request_fails_alone(tiny_llama_dir):
    async def main():
        async with bridge(tiny_llama_dir) as engine:
            with pytest.raises(InvalidRequestError):
                async for _ in engine.generate({"prompt_token_ids": [VOCAB + 5]}, greedy(4)):
                    pass
            ids, _ = await collect(engine, [5, 6], 3)
            assert len(ids) == 3
        with pytest.raises(RuntimeError, match="not running"):
            engine.generate("hi", greedy(2))

    run_on_trio(main)


def test_the_same_bridge_works_on_anyio_asyncio_backend(tiny_llama_dir, alone):
    async def main():
        async with bridge(tiny_llama_dir) as engine:
            return (await collect(engine, prompts(24)[0], 12))[0]

    assert anyio.run(main, backend="asyncio") == alone[0]
