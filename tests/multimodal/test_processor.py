"""Images to encoder inputs and placeholders (multimodal/processor.py), against transformers'
LlavaProcessor: the same expanded ids and pixel values; hashes follow the pixels."""
from __future__ import annotations

import numpy as np
import pytest
import transformers

from vlm_utils import TOKENS_PER_IMAGE, image, make_tiny_llava

from asyncengine.errors import InvalidRequestError
from asyncengine.models.model_info import read_hf_config
from asyncengine.multimodal.image_io import ImageLimits
from asyncengine.multimodal.processor import MultiModalProcessor


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_llava(str(tmp_path_factory.mktemp("llava_proc")))


def test_matches_transformers_processor(llava_dir):
    mm = MultiModalProcessor(llava_dir, read_hf_config(llava_dir), ImageLimits(max_images=3))
    ref = transformers.AutoProcessor.from_pretrained(llava_dir)
    text, imgs = "A <image> and <image> end", [image(1), image(2, (90, 31))]
    want = ref(text=text, images=imgs, return_tensors="np")
    ids, inputs = mm.process(ref.tokenizer.encode(text), {"image": imgs})
    assert ids == want["input_ids"][0].tolist()
    assert [m.length for m in inputs] == [TOKENS_PER_IMAGE] * 2
    for m, px in zip(inputs, want["pixel_values"]):
        assert ids[m.offset:m.end] == [mm.image_token_id] * m.length
        assert np.array_equal(np.frombuffer(m.data, dtype=np.float32).reshape(m.shape), px)
    again = mm.process(ref.tokenizer.encode(text), {"image": [imgs[0], imgs[0]]})[1]
    assert again[0].hash == again[1].hash == inputs[0].hash != inputs[1].hash


def test_refusals(llava_dir):
    mm = MultiModalProcessor(llava_dir, read_hf_config(llava_dir), ImageLimits(max_images=2))
    tok = mm.image_token_id
    with pytest.raises(InvalidRequestError, match="over the limit of 2"):
        mm.process([5, tok], {"image": [image(1)] * 3})
    with pytest.raises(InvalidRequestError, match="1 image placeholders .* for 2 images"):
        mm.process([5, tok], {"image": [image(1), image(2)]})
    with pytest.raises(InvalidRequestError, match="only 'image'"):
        mm.process([5], {"video": []})


def test_prepared_inputs_are_checked_against_their_ids(llava_dir):
    mm = MultiModalProcessor(llava_dir, read_hf_config(llava_dir), ImageLimits(max_images=2))
    ids, inputs = mm.process([5, mm.image_token_id, 6], {"image": [image(1)]})
    assert mm.check_prepared(ids, inputs) == inputs
    import msgspec

    for bad in (msgspec.structs.replace(inputs[0], offset=0), msgspec.structs.replace(inputs[0], data=b"x"),
                msgspec.structs.replace(inputs[0], length=3), "not an input"):
        with pytest.raises(InvalidRequestError, match="do not match"):
            mm.check_prepared(ids, [bad])
