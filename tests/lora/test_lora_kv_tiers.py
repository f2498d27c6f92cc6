"""Adapters and the KV tiers beyond the prefix cache: the offload tier (a disk hit after a restart)
and P/D transfers key blocks by adapter as the prefix cache does (the block hash includes the
adapter's salt), so the same prompt under another adapter never reads the first one's KV.

How each test can fail: a block shared across adapters changes the second adapter's greedy tokens
(the adapters here move every projection they touch), and the hit counters say what was reused."""
from __future__ import annotations

import asyncio
import random

import pytest

from asyncengine import AsyncLLMEngine, EngineConfig, LoRARequest, SamplingParams
from lora_utils import make_adapter

HANG_GUARD_S = 180.0  # only a guard against a hang, never what a test checks
VOCAB = 512
SYSTEM = 48  # tokens every prompt shares: six blocks of 8


@pytest.fixture(scope="module")
def two_adapters(tiny_model_dir, tmp_path_factory):
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("kv-tier-loras")
    return base, {n: LoRARequest(n, i, make_adapter(base, str(root / n), n, seed=i))
                  for i, n in enumerate(("a8", "a16"), start=1)}


def _prompt() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(3, VOCAB) for _ in range(SYSTEM + 5)]


def _config(base: str, **kw) -> EngineConfig:
    return EngineConfig(model=base, dtype="float32", num_kv_blocks=64, block_size=8, enable_lora=True,
                        max_loras=2, max_lora_rank=16, **kw)


async def _tokens(eng, lora: LoRARequest | None, rid: str) -> list[int]:
    toks: list[int] = []
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    async for o in eng.generate({"prompt_token_ids": _prompt()}, params, request_id=rid, lora_request=lora):
        toks.extend(o.token_ids_delta)
    return toks


async def _reference(base: str, loras: dict) -> dict[str, list[int]]:
    """Each adapter's tokens on an engine with no tier and no prefix cache at all."""
    async with AsyncLLMEngine(_config(base, enable_prefix_caching=False)) as eng:
        return {n: await asyncio.wait_for(_tokens(eng, lr, f"ref-{n}"), HANG_GUARD_S) for n, lr in loras.items()}


def test_offload_tier_never_serves_one_adapters_blocks_to_another(two_adapters, tmp_path):
    base, loras = two_adapters

    async def main():
        want = await _reference(base, loras)
        assert want["a8"] != want["a16"]
        async with AsyncLLMEngine(_config(base, kv_offload_dir=str(tmp_path))) as eng:
            assert await asyncio.wait_for(_tokens(eng, loras["a8"], "first"), HANG_GUARD_S) == want["a8"]
        async with AsyncLLMEngine(_config(base, kv_offload_dir=str(tmp_path))) as eng:  # a restart: disk only
            assert await asyncio.wait_for(_tokens(eng, loras["a16"], "other"), HANG_GUARD_S) == want["a16"]
            assert eng.stats()["kv_offload_disk_hit_tokens"] == 0  # a8's blocks are on disk, not a16's
            assert await asyncio.wait_for(_tokens(eng, loras["a8"], "again"), HANG_GUARD_S) == want["a8"]
            assert eng.stats()["kv_offload_disk_hit_tokens"] >= SYSTEM  # the same adapter does read them

    asyncio.run(main())


def test_pd_transfers_under_adapters_equal_colocated(two_adapters, tmp_path):
    """The prefill core computes each request's KV under its adapter and the decode core imports
    it; then the same prompt under the other adapter (whose blocks the decode core must not take
    from the first import) and under the base model."""
    base, loras = two_adapters
    order = [("a8", loras["a8"]), ("a16", loras["a16"]), ("base", None)]

    async def main():
        want = await _reference(base, dict(order))
        async with AsyncLLMEngine.from_config(_config(base, kv_transfer_dir=str(tmp_path), prefill_cores=1,
                                                      decode_cores=1)) as pd:
            got = {n: await asyncio.wait_for(_tokens(pd, lr, f"pd-{n}"), HANG_GUARD_S) for n, lr in order}
            assert got == want
            s = pd.stats()
            assert s["decode"][0]["kv_transfer_imported_requests"] == 3

    asyncio.run(main())
