"""Images and the KV tiers beyond the prefix cache: a block's hash includes the hash of every image
it overlaps, and the offload tier (a disk hit after a restart) and P/D transfers are keyed by that
hash. So the same image reads its blocks back from disk, the same text with another image reads
none, and P/D with images gives the colocated engine's tokens.

How each test can fail: a block shared across images gives the second image the first one's
answer (the tiny LLaVA's tokens depend on the pixels), and the hit counters say what was reused."""
from __future__ import annotations

import asyncio

import pytest

from asyncengine import AsyncLLMEngine, EngineConfig, SamplingParams
from vlm_utils import TOKENS_PER_IMAGE, image, make_tiny_llava

HANG_GUARD_S = 180.0  # only a guard against a hang, never what a test checks
TEXT = "<image> describe this picture please, in a few words"


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_llava(str(tmp_path_factory.mktemp("llava-tiers")))


def _config(model: str, **kw) -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, **kw)


async def _tokens(eng, seed: int, rid: str) -> list[int]:
    toks: list[int] = []
    prompt = {"prompt": TEXT, "multi_modal_data": {"image": [image(seed)]}}
    async for o in eng.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                request_id=rid):
        toks.extend(o.token_ids_delta)
    return toks


async def _reference(model: str, seeds) -> dict[int, list[int]]:
    async with AsyncLLMEngine(_config(model, enable_prefix_caching=False)) as eng:
        return {s: await asyncio.wait_for(_tokens(eng, s, f"ref-{s}"), HANG_GUARD_S) for s in seeds}


def test_offload_tier_serves_an_images_blocks_to_that_image_only(llava_dir, tmp_path):
    async def main():
        want = await _reference(llava_dir, (7, 8))
        assert want[7] != want[8]
        async with AsyncLLMEngine(_config(llava_dir, kv_offload_dir=str(tmp_path))) as eng:
            assert await asyncio.wait_for(_tokens(eng, 7, "first"), HANG_GUARD_S) == want[7]
        async with AsyncLLMEngine(_config(llava_dir, kv_offload_dir=str(tmp_path))) as eng:  # a restart: disk only
            assert await asyncio.wait_for(_tokens(eng, 8, "other"), HANG_GUARD_S) == want[8]
            assert eng.stats()["kv_offload_disk_hit_tokens"] == 0  # the image opens the prompt: nothing shared
            assert await asyncio.wait_for(_tokens(eng, 7, "again"), HANG_GUARD_S) == want[7]
            assert eng.stats()["kv_offload_disk_hit_tokens"] >= TOKENS_PER_IMAGE

    asyncio.run(main())


def test_pd_with_images_equals_colocated(llava_dir, tmp_path):
    """The prefill core encodes the image and computes the prompt's KV; the decode core imports it.
    Then another image under the same text, then the first image again."""
    seeds = (7, 8, 7)

    async def main():
        want = await _reference(llava_dir, set(seeds))
        async with AsyncLLMEngine.from_config(_config(llava_dir, kv_transfer_dir=str(tmp_path), prefill_cores=1,
                                                      decode_cores=1)) as pd:
            got = [await asyncio.wait_for(_tokens(pd, s, f"pd-{i}"), HANG_GUARD_S) for i, s in enumerate(seeds)]
            assert got == [want[s] for s in seeds]
            assert pd.stats()["decode"][0]["kv_transfer_imported_requests"] == 3

    asyncio.run(main())
