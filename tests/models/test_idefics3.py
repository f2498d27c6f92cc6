"""Idefics3 / SmolVLM (models/idefics3.py) token-exact against transformers' own processor + model
(fp32, greedy, the near-tie rule): images split into tiles (and not), alone, mixed with text-only
requests, with prefill chunks that start and end inside a tile's placeholder rows, and under
preemption. Each tile is encoded once, however the prompt is cut. The prefix cache keys blocks by
tile hash: the same image reuses them, the same text with another image does not."""
from __future__ import annotations

import pytest
import transformers
from PIL import Image

from idefics3_utils import TOKENS_PER_TILE, hf_idefics3_greedy, make_tiny_idefics3
from model_utils import compare
from vlm_utils import IMAGE_REQUESTS, core_process_tokens, greedy, image, num_encoded, vlm_prompt

from asyncengine import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the sizes give 2 x 2 tiles + the global one (square-ish), 1 x 2 + 1 (wide) when split
REQUESTS = IMAGE_REQUESTS + [  # tests/vlm_utils.py, and:
    # one colour: its five tiles are the same pixels, one hash (one encoding, five runs)
    ("A plain <image> page", [Image.new("RGB", (40, 50), (200, 30, 30))], 5),
]
REGIMES = {
    "alone": dict(num_kv_blocks=256, block_size=16),
    # chunks of 8 tokens, blocks of 4: chunks start and end inside 16-row tile runs
    "chunked": dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=8),
    # 60 blocks of 4 = 240 slots: the longest request (214 tokens) fits, the batch (~640) does not;
    # prefill chunks of 32 keep several requests growing at once (recompute preemptions)
    "preempt": dict(num_kv_blocks=60, block_size=4, max_num_batched_tokens=32),
}


def _tiles(model_dir, requests) -> int:
    """Distinct tiles (by pixels) of the requests' images, by transformers' image processor."""
    ip = transformers.AutoProcessor.from_pretrained(model_dir).image_processor
    return len({tile.tobytes() for _, ims, _ in requests for im in ims
                for tile in ip(im, return_tensors="np")["pixel_values"][0]})


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    d = make_tiny_idefics3(str(tmp_path_factory.mktemp("idefics3")), split=True)
    return d, hf_idefics3_greedy(d, REQUESTS), _tiles(d, REQUESTS)


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory):
    d = make_tiny_idefics3(str(tmp_path_factory.mktemp("idefics3_unsplit")), split=False, tie=True)
    return d, hf_idefics3_greedy(d, REQUESTS), _tiles(d, REQUESTS)


def _run(checkpoint, **engine):
    d, (refs, prompt_ids), tiles = checkpoint
    llm = LLM(d, dtype="float32", device="cpu", **engine)
    outs = llm.generate([vlm_prompt(t, im) for t, im, _ in REQUESTS], [greedy(n) for _, _, n in REQUESTS],
                        use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompt_ids  # placeholders laid out as transformers does
    compare([o.outputs[0].token_ids for o in outs], refs)
    # every distinct tile encoded once (the first image comes twice), whatever the chunks or preemptions
    assert llm.engine.collective_rpc(num_encoded) == [tiles]
    stats = llm.engine.stats()
    llm.shutdown()
    return stats


@pytest.mark.parametrize("regime", list(REGIMES))
def test_idefics3_parity(split, regime):
    assert split[2] == 5 + 3 + 5 + 5 + 1  # the images are split: 2 x 2 + 1, 1 x 2 + 1, ...; one colour: 1
    stats = _run(split, **REGIMES[regime])
    assert (stats["num_preemptions"] > 0) == (regime == "preempt")


def test_idefics3_parity_unsplit_tied(unsplit):
    """One tile per image, and a head tied to the embedding (no lm_head in the checkpoint)."""
    from safetensors import safe_open

    with safe_open(f"{unsplit[0]}/model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert unsplit[2] == 5
    _run(unsplit, **REGIMES["chunked"])


def test_same_image_hits_the_prefix_cache_another_does_not(split):
    d = split[0]
    llm = LLM(d, dtype="float32", device="cpu", num_kv_blocks=128, block_size=4)
    text = "<image> describe this picture please"
    first = llm.generate(vlm_prompt(text, [image(7)]), greedy(6, logprobs=0), use_tqdm=False)[0]
    s1 = llm.engine.stats()
    same = llm.generate(vlm_prompt(text, [image(7)]), greedy(6, logprobs=0), use_tqdm=False)[0]
    s2 = llm.engine.stats()
    hits = s2["prefix_cache_hits"] - s1["prefix_cache_hits"]
    n = len(same.prompt_token_ids)
    assert hits == (n - 1) // 4 * 4 and hits >= 5 * TOKENS_PER_TILE  # all but the block of the last token
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    assert same.outputs[0].cumulative_logprob == pytest.approx(first.outputs[0].cumulative_logprob, abs=1e-4)
    other = llm.generate(vlm_prompt(text, [image(8)]), greedy(6, logprobs=0), use_tqdm=False)[0]
    s3 = llm.engine.stats()
    assert s3["prefix_cache_hits"] == s2["prefix_cache_hits"]  # the image opens the prompt: no block shared
    # (the tiny LM may pick the same tokens for another image; its probabilities differ)
    assert other.outputs[0].cumulative_logprob != pytest.approx(first.outputs[0].cumulative_logprob, abs=1e-4)
    llm.shutdown()


def test_tiles_cross_to_an_engine_core_process(split):
    """engine_core_process=True: the tiles' encoder inputs cross the core's pipe (msgspec) and the
    async front end lays them out on a worker thread; the same tokens as transformers."""
    d, (refs, _), _ = split
    picked = [0, 1, 3]

    compare(core_process_tokens(d, [REQUESTS[i] for i in picked]), [refs[i] for i in picked])


def test_pixel_shuffle_is_transformers():
    import torch
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector

    from asyncengine.models.idefics3 import pixel_shuffle

    x = torch.randn(3, 64, 5)
    for scale in (2, 4):
        assert torch.equal(pixel_shuffle(x, scale), Idefics3Connector.pixel_shuffle(None, x, scale))
