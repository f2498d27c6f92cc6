"""Images through the OpenAI server: the official openai client sends a base64 PNG as an
``image_url`` content part and streams an answer that is token-exact with transformers' processor +
model on the same rendered prompt (so does the websocket chat); hostile images (a header declaring
100,000 x 100,000, a truncated file, too many images, remote and out-of-folder URLs) are each a
400, and the engine is left clean."""
from __future__ import annotations

import asyncio
import base64

import openai
import pytest
import torch
import transformers
from PIL import Image

from live_server import LiveServer, make_engine
from vlm_utils import image, make_tiny_llava, png_bytes, stream_chat

from asyncengine.integrations.openai_server.media import MediaPolicy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _url(b: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(b).decode()


def _message(*urls, text="What is this?"):
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    d = make_tiny_llava(str(tmp_path_factory.mktemp("llava_srv")))
    media = tmp_path_factory.mktemp("media")
    (media / "a.png").write_bytes(png_bytes(image(3)))
    s = LiveServer(make_engine(d, limit_mm_per_prompt=4, mm_max_pixels=1 << 20), own_engine=True,
                   media_policy=MediaPolicy(allowed_local_path=str(media))).start()
    yield s, d, media
    s.stop()


def _reference(d: str, img, max_tokens: int) -> str:
    proc = transformers.AutoProcessor.from_pretrained(d)
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": "<image>\nWhat is this?"}],
                                              add_generation_prompt=True, tokenize=False)
    inp = proc(text=text, images=[img], return_tensors="pt")
    model = transformers.LlavaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(**inp, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return proc.tokenizer.decode(out[0, inp["input_ids"].shape[1]:])


def test_openai_client_streams_an_answer_about_a_png(vlm):
    s, d, _ = vlm
    img = image(11, (45, 33))

    text, usage = stream_chat(s.base_url, _message(_url(png_bytes(img))), 8)
    assert text == _reference(d, img, 8)
    assert usage.completion_tokens == 8 and usage.prompt_tokens > 16  # the image's 16 placeholders counted
    s.wait_clean()


def test_local_file_under_the_allowed_folder(vlm):
    s, _, media = vlm
    c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(model="tiny-llama", messages=_message(f"file://{media}/a.png"), max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")


def bomb_png() -> bytes:
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(b"\x00")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("case", ["bomb", "truncated", "too_many", "remote", "outside", "not_image", "big"])
def test_hostile_images_are_400(vlm, case, tmp_path):
    s, _, _ = vlm
    good = _url(png_bytes(image(1)))
    outside = tmp_path / "b.png"
    outside.write_bytes(png_bytes(image(2)))
    messages = {
        "bomb": _message(_url(bomb_png())),
        "truncated": _message(_url(png_bytes(image(4, (64, 64)))[:300])),
        "too_many": _message(*[good] * 40),
        "remote": _message("http://example.com/cat.png"),
        "outside": _message(f"file://{outside}"),
        "not_image": _message("data:image/png;base64," + base64.b64encode(b"hello").decode()),
        "big": _message(_url(png_bytes(Image.new("RGB", (1100, 1000), (9, 9, 9))))),  # over mm_max_pixels (1 Mi)
    }[case]
    c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=3)
    s.wait_clean()
    # a normal request alongside still works
    assert c.chat.completions.create(model="tiny-llama", messages=_message(good), max_tokens=2).choices


def test_text_model_refuses_images(server):
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        c.chat.completions.create(model="tiny-llama", messages=_message(_url(png_bytes(image(1)))), max_tokens=2)


async def test_websocket_chat_takes_an_image_and_refuses_a_broken_one(vlm):
    """/v1/ws/chat (the web page's socket) takes image_url parts as /v1/chat/completions does: the
    same answer as transformers; a truncated image is an error frame for that id only."""
    import json

    import websockets

    s, d, _ = vlm
    img = image(13, (30, 40))
    frame = {"type": "chat", "id": 1, "messages": _message(_url(png_bytes(img))), "max_tokens": 8,
             "temperature": 0, "ignore_eos": True}

    async def recv(ws) -> dict:
        return json.loads(await asyncio.wait_for(ws.recv(), 60))

    async with websockets.connect(s.ws_url) as ws:
        await ws.send(json.dumps(frame))
        text, f = "", await recv(ws)
        while f["type"] == "delta":
            text, f = text + f["text"], await recv(ws)
        assert f["type"] == "done" and f["finish_reason"] == "length", f
        broken = _message(_url(png_bytes(image(4, (64, 64)))[:300]))
        await ws.send(json.dumps({**frame, "id": 2, "messages": broken}))
        err = await recv(ws)
        assert err["type"] == "error" and err["id"] == 2 and "image" in err["error"]["message"], err
    assert text == _reference(d, img, 8)
    await asyncio.to_thread(s.wait_clean)
