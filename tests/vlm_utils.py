"""A tiny random LLaVA-1.5 checkpoint (CLIP tower + projector + Llama LM) saved with its processor,
Pillow-made images, and transformers' own greedy reference (its processor + model), for the
multimodal tests."""
from __future__ import annotations

import io

import numpy as np
import torch
import transformers

from model_utils import Reference, save_tiny_tokenizer, scale_weights

IMAGE_SIZE, PATCH = 28, 7
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2  # 16: CLIP's class token dropped ("default" strategy)


def make_tiny_llava(out_dir: str, seed: int = 0) -> str:
    save_tiny_tokenizer(out_dir, 512)
    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH)
    tc = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=520, max_position_embeddings=1024,
                                  rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                  tie_word_embeddings=False)
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_seq_length=TOKENS_PER_IMAGE,
                                   image_token_index=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(cfg)
    scale_weights(model)
    model.save_pretrained(out_dir)
    ip = transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                         crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    transformers.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=PATCH, image_token="<image>",
                                vision_feature_select_strategy="default",
                                num_additional_image_tokens=1).save_pretrained(out_dir)
    return out_dir


def image(seed: int, size=(40, 50), mode: str = "RGB"):
    """A random-pixel Pillow image (``size`` = width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    return img if mode == "RGB" else img.convert(mode)


def png_bytes(img, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def hf_greedy(model, make_inputs, requests) -> tuple[list[Reference], list[list[int]]]:
    """transformers' ``model.generate`` one request at a time, greedy, fp32, EOS ignored, on the
    inputs ``make_inputs(text, images)`` builds (its processor's). ``requests``: (text with image
    marks, images, max tokens). Returns (references, the processor's prompt ids: placeholders
    expanded)."""
    refs, prompts = [], []
    with torch.inference_mode():
        for text, images, max_tokens in requests:
            inp = make_inputs(text, images)
            out = model.generate(**inp, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            n = inp["input_ids"].shape[1]
            margins = [float(torch.topk(lg[0].float(), 2).values.diff().abs()) for lg in out.logits]
            refs.append(Reference(out.sequences[0, n:].tolist(), margins))
            prompts.append(inp["input_ids"][0].tolist())
    return refs, prompts


def hf_llava_greedy(model_dir: str, requests) -> tuple[list[Reference], list[list[int]]]:
    """:func:`hf_greedy` with transformers' processor + LlavaForConditionalGeneration."""
    proc = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return hf_greedy(model, lambda text, images: proc(text=text, images=images or None, return_tensors="pt"), requests)


# ---- hostile images (tests/integrations/test_hostile_images.py, benchmarks/hostile_images.py)

def data_url(b: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64," + base64.b64encode(b).decode()


def image_message(*urls: str, text: str = "What is this?") -> list[dict]:
    """One OpenAI chat user message: the images as ``image_url`` parts, then the text."""
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": text}]}]


def declared_size_png(width: int, height: int) -> bytes:
    """A ~60-byte PNG whose header declares ``width`` x ``height`` pixels (a decompression bomb's header)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(b"\x00")) + chunk(b"IEND", b"")


def padded_jpeg(total_bytes: int) -> bytes:
    """A valid JPEG of about ``total_bytes``: a small picture behind comment segments (64 KiB each)."""
    import struct

    small = png_bytes(image(5, (64, 64)), "JPEG", quality=90)
    com = b"\xff\xfe" + struct.pack(">H", 0xFFFF) + bytes(0xFFFD)
    return small[:2] + com * max(1, (total_bytes - len(small)) // len(com)) + small[2:]


def hostile_chats() -> dict[str, list[dict]]:
    """The issue's hostile set, as chat messages: a 1x1-pixel-sized PNG that declares 100,000 x
    100,000, a 20 MB JPEG, truncated PNG and JPEG files, 40 images in one message."""
    good = data_url(png_bytes(image(1)))
    return {
        "bomb_100k_x_100k": image_message(data_url(declared_size_png(100_000, 100_000))),
        "jpeg_20mb": image_message(data_url(padded_jpeg(20 * 10**6), "image/jpeg")),
        "truncated_png": image_message(data_url(png_bytes(image(4, (64, 64)))[:300])),
        "truncated_jpeg": image_message(data_url(png_bytes(image(6, (64, 64)), "JPEG")[:400], "image/jpeg")),
        "forty_images": image_message(*[good] * 40),
    }


def vlm_prompt(text: str, images: list):
    """``LLM.generate``'s prompt for a text with image marks and its images (a bare text without)."""
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def greedy(n: int, **kw):
    from asyncengine import SamplingParams  # lazy: the helpers' imports stay light

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def num_encoded(worker) -> int:
    """Encoder inputs the worker's encoder cache has run (a collective_rpc target)."""
    return worker.runner.encoder_cache.num_encoded


def core_process_tokens(model_dir: str, requests: list) -> list[list[int]]:
    """``requests`` (text, images, max tokens) through an AsyncLLMEngine whose core is its own
    process (the images' encoder inputs cross its pipe as msgspec), concurrently; their tokens."""
    import asyncio

    from asyncengine import AsyncLLMEngine, EngineConfig

    async def main():
        eng = AsyncLLMEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu", engine_core_process=True,
                                          num_kv_blocks=128, block_size=8, freeze_gc_after_load=False))
        async with eng:
            async def one(text, images, n):
                async for out in eng.generate(vlm_prompt(text, images), greedy(n)):
                    pass
                return out.outputs[0].token_ids
            return await asyncio.gather(*(one(*r) for r in requests))

    return asyncio.run(main())


def stream_chat(base_url: str, messages: list[dict], max_tokens: int) -> tuple[str, object]:
    """One greedy chat completion streamed by the official ``openai`` client (EOS ignored): its
    text and its usage."""
    import asyncio

    import openai

    async def main():
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0) as c:
            stream = await c.chat.completions.create(
                model="tiny-llama", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                usage = chunk.usage or usage
            return text, usage

    return asyncio.run(main())


# (text with <image> marks, images, max tokens): one image, two, an image first, and text-only rows
# between them: the parity workload of the <image>-token models (LLaVA, Idefics3)
IMAGE_REQUESTS = [
    ("The quick <image> brown fox", [image(1)], 10),
    ("def f(x):", [], 8),
    ("<image>\nParis is the capital of", [image(2, (64, 30))], 12),
    ("Two: <image> and <image>, compare", [image(3), image(4, (20, 20))], 9),
    ("The lazy dog", [], 6),
    ("<image> again the first", [image(1)], 7),
]
