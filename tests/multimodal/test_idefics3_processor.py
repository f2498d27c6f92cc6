"""Idefics3's placeholders and tiles (multimodal/idefics3_processor.py) against transformers'
Idefics3Processor: the same expanded ids (tiles, row/column tags, newlines) and pixel values, one
input per tile whose run holds exactly that tile's image tokens; hashes follow the pixels."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import transformers

from idefics3_utils import TOKENS_PER_TILE, make_tiny_idefics3
from vlm_utils import image

from asyncengine.errors import InvalidRequestError
from asyncengine.models.model_info import read_hf_config
from asyncengine.multimodal.idefics3_processor import Idefics3Processor
from asyncengine.multimodal.image_io import ImageLimits
from asyncengine.multimodal.processor import processor_class, vision_info


@pytest.fixture(scope="module", params=[True, False], ids=["split", "unsplit"])
def model_dir(request, tmp_path_factory):
    return make_tiny_idefics3(str(tmp_path_factory.mktemp("idefics3_proc")), split=request.param)


def test_matches_transformers_processor(model_dir):
    cfg = read_hf_config(model_dir)
    assert processor_class(vision_info(cfg)) is Idefics3Processor
    mm = Idefics3Processor(model_dir, cfg, ImageLimits(max_images=3))
    ref = transformers.AutoProcessor.from_pretrained(model_dir)
    text = "A <image> and <image>\n<image> end"
    imgs = [image(1), image(2, (90, 31)), image(3, (20, 70))]
    want = ref(text=text, images=imgs, return_tensors="np")
    ids, inputs = mm.process(ref.tokenizer.encode(text), {"image": imgs})
    assert ids == want["input_ids"][0].tolist()
    tiles = want["pixel_values"][0]
    assert len(inputs) == len(tiles) and all(m.length == TOKENS_PER_TILE for m in inputs)
    # the runs are the prompt's image tokens exactly, in order, each one tile's
    assert [p for m in inputs for p in range(m.offset, m.end)] == [i for i, t in enumerate(ids) if t == mm.image_token_id]
    for m, px in zip(inputs, tiles):
        assert np.array_equal(np.frombuffer(m.data, dtype=np.float32).reshape(m.shape), px)
    assert mm.check_prepared(ids, inputs) == inputs
    again = mm.process(ref.tokenizer.encode("<image><image>"), {"image": [imgs[0], imgs[0]]})[1]
    first = [m.hash for m in inputs[:len(again) // 2]]  # the first image's tiles
    assert [m.hash for m in again] == first + first
    assert not set(first) & {m.hash for m in inputs[len(first):]}  # other images: other tiles


def test_refusals(model_dir):
    mm = Idefics3Processor(model_dir, read_hf_config(model_dir), ImageLimits(max_images=2))
    tok = mm.image_token_id
    with pytest.raises(InvalidRequestError, match="over the limit of 2"):
        mm.process([5, tok], {"image": [image(1)] * 3})
    with pytest.raises(InvalidRequestError, match="1 image placeholders .* for 2 images"):
        mm.process([5, tok], {"image": [image(1), image(2)]})
    ids, inputs = mm.process([5, tok, 6], {"image": [image(1)]})
    with pytest.raises(InvalidRequestError, match="tiles in one prompt, over the limit of 2 images of 37"):
        mm.check_prepared(ids, inputs[:1] * (2 * 37 + 1))
    for bad in (msgspec.structs.replace(inputs[0], offset=0), msgspec.structs.replace(inputs[0], data=b"x"),
                msgspec.structs.replace(inputs[0], length=3), "not an input"):
        with pytest.raises(InvalidRequestError, match="do not match"):
            mm.check_prepared(ids, [bad])
