"""A tiny random Qwen2-VL checkpoint (dynamic-resolution ViT + Qwen2 LM with M-RoPE) saved with
its image processor and tokenizer, and transformers' own greedy reference (its image processor +
model), for the Qwen2-VL tests. Patch 14, merge 2: an image gives (h/28) x (w/28) placeholder rows; the processor's
``min_pixels`` is lowered to 28 x 28 (a 28 x 84 image stays as it is) and ``max_pixels`` to
112 x 112 (a larger image is shrunk)."""
from __future__ import annotations

import torch
import transformers

from model_utils import Reference, save_tiny_tokenizer, scale_weights
from vlm_utils import hf_greedy

PATCH, MERGE = 14, 2
MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112
SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def make_tiny_qwen2_vl(out_dir: str, seed: int = 0, version: str = "2", tie: bool = False) -> str:
    """``version`` "2": Qwen2-VL; "2.5": Qwen2.5-VL (its windowed ViT: windows of 2 x 2 merged rows,
    the second block full attention). ``tie``: the head is the embedding, said at the top level only
    (as Qwen2-VL-2B's config.json says it)."""
    save_tiny_tokenizer(out_dir, 512)
    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = dict(vocab_size=520, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=0,
                eos_token_id=1, pad_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    common = dict(patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, in_channels=3, num_heads=4,
                  depth=2)
    if version == "2":
        config_cls, model_cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        vision = dict(common, embed_dim=32, hidden_size=64, mlp_ratio=2)
    else:
        config_cls, model_cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        vision = dict(common, hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=2 * PATCH * MERGE,
                      fullatt_block_indexes=[1])
    cfg = config_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                     video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                     vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    scale_weights(model)
    model.save_pretrained(out_dir)
    # the Pillow backend (transformers' default one needs torchvision)
    ip_cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    ip = ip_cls(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=PATCH, merge_size=MERGE,
                temporal_patch_size=2)
    ip.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def hf_inputs(model_dir: str, text: str, images) -> dict:
    """What transformers' Qwen2VLProcessor makes (its class wants torchvision for its video part,
    absent here, so its three steps are done as it does them): the image processor's pixel values
    and grids; each ``<|image_pad|>`` of the text repeated grid.prod() / merge**2 times, then
    tokenized; ``mm_token_type_ids`` 1 on image tokens."""
    ip = transformers.AutoImageProcessor.from_pretrained(model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    out = {}
    if images:
        out = dict(ip(images=images, return_tensors="pt"))
        parts = text.split("<|image_pad|>")
        rows = [int(g.prod()) // ip.merge_size ** 2 for g in out["image_grid_thw"]]
        text = parts[0] + "".join("<|image_pad|>" * n + p for n, p in zip(rows, parts[1:]))
    ids = tok(text, return_tensors="pt")
    out["input_ids"], out["attention_mask"] = ids["input_ids"], ids["attention_mask"]
    out["mm_token_type_ids"] = (ids["input_ids"] == tok.convert_tokens_to_ids("<|image_pad|>")).int()
    return out


def hf_qwen2_vl_greedy(model_dir: str, requests) -> tuple[list[Reference], list[list[int]]]:
    """``vlm_utils.hf_greedy`` with transformers' image processor (:func:`hf_inputs`) + its
    Qwen2(.5)-VL model. ``requests``: (text with <|image_pad|> marks, images, max tokens)."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return hf_greedy(model, lambda text, images: hf_inputs(model_dir, text, images), requests)
