"""engine/warmup.py: the warm-up request the CLI and the server run before "ready" leaves nothing
behind, and fits a context too short for its chat prompt."""
from __future__ import annotations

import asyncio

import pytest

from asyncengine import AsyncLLMEngine, EngineConfig
from asyncengine.engine.warmup import warm_up
from model_utils import make_tiny_bert


@pytest.mark.parametrize("max_model_len,model", [(None, "llama"), (8, "llama"), (None, "bert")])
def test_warm_up_leaves_the_engine_clean(tiny_llama_dir, tmp_path, max_model_len, model):
    """(A BERT encoder cannot generate: its warm-up is one short embedding.)"""
    if model == "bert":
        make_tiny_bert(tmp_path)
    path = tiny_llama_dir if model == "llama" else str(tmp_path)

    async def main():
        engine = AsyncLLMEngine(EngineConfig(model=path, dtype="float32", num_kv_blocks=64,
                                             max_model_len=max_model_len))
        async with engine:
            before = engine.stats()["num_steps"]
            await warm_up(engine)
            for _ in range(2000):  # a bounded wait for the abort-free finish to be routed
                s = engine.stats()
                if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_streams"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert s["num_steps"] > before  # the model really ran
            assert s["num_running"] == s["num_waiting"] == s["num_streams"] == 0
            assert s["num_free_kv_blocks"] == s["num_kv_blocks"]

    asyncio.run(main())
