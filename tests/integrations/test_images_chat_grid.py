"""A dynamic-resolution model (Qwen2-VL) through the OpenAI server: the official openai client sends
a base64 PNG, the chat template's image part becomes <|vision_start|><|image_pad|><|vision_end|>,
the image's placeholder count follows its size, and the streamed answer equals transformers' own
model on the same rendered prompt (greedy, fp32)."""
from __future__ import annotations


import pytest
import torch
import transformers

from live_server import LiveServer, make_engine
from qwen_vl_utils import hf_inputs, make_tiny_qwen2_vl
from vlm_utils import data_url, image, image_message, png_bytes, stream_chat

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    d = make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("qwen2vl_srv")))
    tok = transformers.AutoTokenizer.from_pretrained(d)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(d)
    s = LiveServer(make_engine(d, limit_mm_per_prompt=2, max_model_len=256), own_engine=True).start()
    yield s, d
    s.stop()


def _reference(d: str, img, max_tokens: int) -> str:
    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>\nWhat is this?<|im_end|>\n"  # parts: lines
            "<|im_start|>assistant\n")
    inp = hf_inputs(d, text, [img])
    model = transformers.AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(**inp, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    return tok.decode(out[0, inp["input_ids"].shape[1]:])


def test_openai_client_streams_an_answer_about_a_png(qwen_vl):
    s, d = qwen_vl
    img = image(5, (56, 84))

    text, usage = stream_chat(s.base_url, image_message(data_url(png_bytes(img))), 6)
    assert text == _reference(d, img, 6)
    assert usage.completion_tokens == 6 and usage.prompt_tokens > (56 // 28) * (84 // 28)  # its rows counted
    s.wait_clean()

