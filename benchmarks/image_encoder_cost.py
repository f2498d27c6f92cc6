#!/usr/bin/env python
"""What an image costs next to text: a random-weight LLaVA-shaped checkpoint (a CLIP ViT-B/14-shaped
tower: 768 hidden, 12 layers; a SmolLM2-135M-shaped Llama: 576 hidden, 30 layers) at each image
size, timing (a) the vision tower + projector alone for one image, (b) a prompt of one image and a
few words end to end (encoder + LM prefill over its placeholders, one output token), and (c) a
text-only prompt of the same token count. Prefix caching off and a new image every call (so
neither the prefix cache nor the encoder cache serves a repeat); medians of --rounds.

    python benchmarks/image_encoder_cost.py --sizes 224 336 --rounds 5 --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from model_utils import save_tiny_tokenizer, scale_weights  # noqa: E402 (the tests' tiny tokenizer)
from single_stream import cpu_info  # noqa: E402

PATCH = 14


def make_checkpoint(root: Path, size: int) -> None:
    save_tiny_tokenizer(str(root), 512)
    tok = transformers.AutoTokenizer.from_pretrained(str(root))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vc = transformers.CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                       num_attention_heads=12, image_size=size, patch_size=PATCH)
    tc = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, vocab_size=520, max_position_embeddings=4096)
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(cfg)
    scale_weights(model)
    model.save_pretrained(str(root))
    ip = transformers.CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    transformers.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=PATCH,
                                vision_feature_select_strategy="default", num_additional_image_tokens=1
                                ).save_pretrained(str(root))


def median_s(fn, rounds: int) -> float:
    fn()  # warm
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(size: int, rounds: int) -> dict:
    from PIL import Image

    from asyncengine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as d:
        make_checkpoint(Path(d), size)
        llm = LLM(d, dtype="float32", device="cpu", enable_prefix_caching=False, max_num_batched_tokens=4096)
        rng = np.random.default_rng(0)

        def image_prompt():  # a new image every call: the encoder cache (keyed by the image) never hits
            img = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
            return {"prompt": "<image> describe it", "multi_modal_data": {"image": img}}

        one = SamplingParams(max_tokens=1, temperature=0.0)
        first = image_prompt()
        img = first["multi_modal_data"]["image"]
        n_tokens = len(llm.generate(first, one, use_tqdm=False)[0].prompt_token_ids)
        from asyncengine.config import EngineConfig
        from asyncengine.models.loader import load_model

        model = load_model(EngineConfig(model=d, dtype="float32", device="cpu")).model  # the tower alone
        px = torch.from_numpy(np.asarray(transformers.AutoImageProcessor.from_pretrained(d)(
            [img], return_tensors="np")["pixel_values"], dtype=np.float32))
        out = {"image_px": size, "placeholder_tokens": (size // PATCH) ** 2, "prompt_tokens": n_tokens}
        with torch.inference_mode():
            out["encoder_ms"] = 1e3 * median_s(lambda: model.encode_images(px), rounds)
        text_ids = [5 + i % 400 for i in range(n_tokens)]
        out["image_prompt_ms"] = 1e3 * median_s(lambda: llm.generate(image_prompt(), one, use_tqdm=False), rounds)
        out["text_prompt_ms"] = 1e3 * median_s(
            lambda: llm.generate({"prompt_token_ids": text_ids}, one, use_tqdm=False), rounds)
        llm.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[224, 336])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps({"cpu": cpu_info(), "threads": args.threads}))
    for size in args.sizes:
        print(json.dumps(measure(size, args.rounds)))


if __name__ == "__main__":
    main()
