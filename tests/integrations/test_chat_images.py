"""Images in the framework adapters (integrations/chat_images.py): LangChain's ``image_url`` and
standard ``image`` content blocks and LlamaIndex's ImageBlocks reach a tiny LLaVA, and the answer is
transformers' own (its processor + model, greedy, fp32) for the same rendered chat; URLs other than
data: URLs are refused, and so are images for a text-only model."""
from __future__ import annotations

import base64

import pytest
import torch
import transformers

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.messages import HumanMessage  # noqa: E402
from llama_index.core.base.llms.types import ImageBlock, TextBlock  # noqa: E402
from llama_index.core.llms import ChatMessage  # noqa: E402
from vlm_utils import data_url, image, make_tiny_llava, png_bytes  # noqa: E402

from asyncengine.integrations.engine_thread import close_shared_engines  # noqa: E402
from asyncengine.integrations.langchain import ChatAsyncEngine  # noqa: E402
from asyncengine.integrations.llamaindex import AsyncEngineLLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
OPTIONS = {"dtype": "float32", "max_model_len": 1024, "num_kv_blocks": 64}
N = 6
QUESTION = "What is this?"


@pytest.fixture(autouse=True, scope="module")
def _close_engines():
    yield
    close_shared_engines()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """(checkpoint, image, transformers' N greedy tokens for '<image>\\nWhat is this?', its tokenizer)."""
    d = make_tiny_llava(str(tmp_path_factory.mktemp("llava_adapters")))
    img = image(21, (45, 33))
    proc = transformers.AutoProcessor.from_pretrained(d)
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": "<image>\n" + QUESTION}],
                                              add_generation_prompt=True, tokenize=False)
    inp = proc(text=text, images=[img], return_tensors="pt")
    model = transformers.LlavaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(**inp, max_new_tokens=N, min_new_tokens=N, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return d, img, out[0, inp["input_ids"].shape[1]:].tolist(), proc.tokenizer


def _expected(tok, ids, stop_at_eos: bool) -> str:
    if stop_at_eos and tok.eos_token_id in ids:
        ids = ids[:ids.index(tok.eos_token_id)]
    return tok.decode(ids, skip_special_tokens=True)


def test_langchain_image_blocks(llava):
    d, img, ids, tok = llava
    png = png_bytes(img)
    llm = ChatAsyncEngine(model=d, engine_options=OPTIONS, max_tokens=N, min_tokens=N, temperature=0.0)
    want = _expected(tok, ids, stop_at_eos=False)
    assert want
    openai_style = HumanMessage([{"type": "image_url", "image_url": {"url": data_url(png)}},
                                 {"type": "text", "text": QUESTION}])
    assert llm.invoke([openai_style]).content == want
    standard = HumanMessage([{"type": "image", "base64": base64.b64encode(png).decode(), "mime_type": "image/png"},
                             {"type": "text", "text": QUESTION}])
    assert "".join(c.content for c in llm.stream([standard])) == want
    with pytest.raises(ValueError, match="not fetched"):
        llm.invoke([HumanMessage([{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}},
                                  {"type": "text", "text": QUESTION}])])


async def test_llamaindex_image_blocks(llava, tmp_path):
    d, img, ids, tok = llava
    path = tmp_path / "pic.png"
    path.write_bytes(png_bytes(img))
    llm = AsyncEngineLLM(model=d, engine_options=OPTIONS, max_tokens=N, temperature=0.0)
    want = _expected(tok, ids, stop_at_eos=True)  # (no min_tokens knob here: it stops at EOS)
    assert want
    for block in (ImageBlock(image=png_bytes(img)), ImageBlock(path=path), ImageBlock(url=data_url(png_bytes(img)))):
        msg = ChatMessage(role="user", blocks=[block, TextBlock(text=QUESTION)])
        assert (await llm.achat([msg])).message.content == want
    with pytest.raises(ValueError, match="not fetched"):
        llm.chat([ChatMessage(role="user", blocks=[ImageBlock(url="https://example.com/a.png"),
                                                  TextBlock(text=QUESTION)])])


def test_a_text_model_refuses_images(tiny_llama_dir):
    msg = HumanMessage([{"type": "image_url", "image_url": {"url": data_url(png_bytes(image(1)))}}])
    with pytest.raises(ValueError, match="only text"):
        ChatAsyncEngine(model=tiny_llama_dir, engine_options={"dtype": "float32"}, max_tokens=2).invoke([msg])
    block = ChatMessage(role="user", blocks=[ImageBlock(image=png_bytes(image(1))), TextBlock(text="hi")])
    with pytest.raises(ValueError, match="takes no images"):
        AsyncEngineLLM(model=tiny_llama_dir, engine_options={"dtype": "float32"}, max_tokens=2).chat([block])
