#!/usr/bin/env python
"""What an image costs next to text: a random-weight LLaVA-shaped checkpoint (a CLIP ViT-B/14-shaped
tower: 768 hidden, 12 layers; a SmolLM2-135M-shaped Llama: 576 hidden, 30 layers) at each image
size, timing (a) the vision tower + projector alone for one image, (b) a prompt of one image and a
few words end to end (encoder + LM prefill over its placeholders, one output token), and (c) a
text-only prompt of the same token count. Prefix caching and encoder-output reuse off (each round
encodes again); medians of --rounds.

``--arch idefics3``: a SmolVLM-256M-shaped checkpoint instead (a SigLIP-B/16-shaped tower: 768
hidden, 12 layers, pixel shuffle by 4; the same LM), images not split: one tile of --sizes px per
image (a split image costs its rows x cols + 1 tiles, each as much).

    python benchmarks/image_encoder_cost.py --sizes 224 336 --rounds 5 --threads 2
    python benchmarks/image_encoder_cost.py --arch idefics3 --sizes 384 512 --rounds 3 --threads 2
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
IDEFICS3_PATCH = 16


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


def make_idefics3_checkpoint(root: Path, size: int) -> None:
    save_tiny_tokenizer(str(root), 512)
    tok = transformers.AutoTokenizer.from_pretrained(str(root))
    tags = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    tok.add_special_tokens({"additional_special_tokens": tags + [f"<row_{r}_col_{c}>" for r in range(1, 7)
                                                                  for c in range(1, 7)]})
    vc = transformers.Idefics3VisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                           num_attention_heads=12, image_size=size, patch_size=IDEFICS3_PATCH)
    tc = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, vocab_size=560, max_position_embeddings=4096)
    cfg = transformers.Idefics3Config(vision_config=vc.to_dict(), text_config=tc.to_dict(), scale_factor=4,
                                      image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(cfg)
    scale_weights(model)
    model.save_pretrained(str(root))
    ip = transformers.Idefics3ImageProcessor(size={"longest_edge": size}, max_image_size={"longest_edge": size},
                                             do_image_splitting=False)
    transformers.Idefics3Processor(image_processor=ip, tokenizer=tok,
                                   image_seq_len=placeholders("idefics3", size)).save_pretrained(str(root))


def placeholders(arch: str, size: int) -> int:
    """Placeholder rows of one image (LLaVA) or one tile (Idefics3)."""
    return (size // PATCH) ** 2 if arch == "llava" else (size // IDEFICS3_PATCH) ** 2 // 16


def median_s(fn, rounds: int) -> float:
    fn()  # warm
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(size: int, rounds: int, arch: str = "llava") -> dict:
    from PIL import Image

    from asyncengine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as d:
        (make_checkpoint if arch == "llava" else make_idefics3_checkpoint)(Path(d), size)
        llm = LLM(d, dtype="float32", device="cpu", enable_prefix_caching=False, max_num_batched_tokens=4096,
                  mm_encoder_cache_tokens=0)  # every round encodes its image again
        img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8))
        one = SamplingParams(max_tokens=1, temperature=0.0)
        image_prompt = {"prompt": "<image> describe it", "multi_modal_data": {"image": img}}
        n_tokens = len(llm.generate(image_prompt, one, use_tqdm=False)[0].prompt_token_ids)
        from asyncengine.config import EngineConfig
        from asyncengine.models.loader import load_model

        model = load_model(EngineConfig(model=d, dtype="float32", device="cpu")).model  # the tower alone
        px = torch.from_numpy(np.asarray(transformers.AutoImageProcessor.from_pretrained(d)(
            [img], return_tensors="np")["pixel_values"], dtype=np.float32).reshape(-1, 3, size, size))
        out = {"arch": arch, "image_px": size, "placeholder_tokens": placeholders(arch, size), "prompt_tokens": n_tokens}
        with torch.inference_mode():
            out["encoder_ms"] = 1e3 * median_s(lambda: model.encode_images(px), rounds)
        text_ids = [5 + i % 400 for i in range(n_tokens)]
        out["image_prompt_ms"] = 1e3 * median_s(lambda: llm.generate(image_prompt, one, use_tqdm=False), rounds)
        out["text_prompt_ms"] = 1e3 * median_s(
            lambda: llm.generate({"prompt_token_ids": text_ids}, one, use_tqdm=False), rounds)
        llm.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[224, 336])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arch", choices=["llava", "idefics3"], default="llava")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps({"cpu": cpu_info(), "threads": args.threads}))
    for size in args.sizes:
        print(json.dumps(measure(size, args.rounds, args.arch)))


if __name__ == "__main__":
    main()
