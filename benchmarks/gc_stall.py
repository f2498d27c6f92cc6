#!/usr/bin/env python
"""Event-loop stalls from garbage collection while serving: N requests submitted at once to the
in-process AsyncLLMEngine, a heartbeat task on the same loop (5 ms sleeps) records its worst lag,
and gc.callbacks time every collection.

    python benchmarks/gc_stall.py --model models/llama-bench            # freeze_gc_after_load=True
    python benchmarks/gc_stall.py --model models/llama-bench --no-freeze
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import time

from asyncengine import AsyncLLMEngine, EngineConfig, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--no-freeze", action="store_true", help="freeze_gc_after_load=False")
    a = ap.parse_args()

    engine = AsyncLLMEngine.from_config(EngineConfig(model=a.model, dtype=a.dtype,
                                                     freeze_gc_after_load=not a.no_freeze))
    collections: list[tuple[int, float]] = []
    started: dict[str, float] = {}

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            collections.append((info["generation"], (time.perf_counter() - started["t"]) * 1000))

    gc.callbacks.append(on_gc)

    async def run() -> dict:
        rng = random.Random(0)
        lags: list[float] = []

        async def heartbeat():
            while True:
                t0 = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append((time.perf_counter() - t0) * 1000 - 5)

        async def one():
            prompt = [rng.randrange(3, engine.core.vocab_size) for _ in range(a.prompt_len)]
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)):
                pass

        hb = asyncio.create_task(heartbeat())
        await asyncio.gather(*(one() for _ in range(a.num_requests)))
        hb.cancel()
        await engine.shutdown()
        full = [ms for g, ms in collections if g == 2]
        return {"freeze_gc_after_load": not a.no_freeze, "worst_loop_lag_ms": round(max(lags), 1),
                "full_collections_while_serving": len(full),
                "worst_full_collection_ms": round(max(full, default=0.0), 1)}

    collections.clear()  # only what happens while serving
    print(json.dumps(asyncio.run(run())))


if __name__ == "__main__":
    main()
