"""A tiny random Idefics3 checkpoint (SmolVLM's shape: Idefics3 vision tower + pixel-shuffle
connector + Llama LM) saved with its processor, and transformers' own greedy reference (its
processor + model), for the Idefics3 tests. Images come from vlm_utils.image."""
from __future__ import annotations

import torch
import transformers

from model_utils import Reference, save_tiny_tokenizer, scale_weights
from vlm_utils import hf_greedy

TILE, PATCH, SCALE = 32, 4, 2  # a 32 x 32 tile: 8 x 8 patches, pixel-shuffled 2 x 2
TOKENS_PER_TILE = (TILE // PATCH) ** 2 // SCALE ** 2  # 16
LONGEST_EDGE = 2 * TILE  # images are resized to this longest edge, then cut into up to 2 x 2 tiles


def make_tiny_idefics3(out_dir: str, split: bool = True, tie: bool = False, seed: int = 0) -> str:
    """``split``: the image processor's ``do_image_splitting`` (False: one tile per image); ``tie``:
    the head is the embedding (the outer config's ``tie_word_embeddings``, as transformers reads it)."""
    save_tiny_tokenizer(out_dir, 512)
    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    tags = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    tok.add_special_tokens({"additional_special_tokens": tags + [f"<row_{r}_col_{c}>" for r in range(1, 7)
                                                                  for c in range(1, 7)]})
    vc = transformers.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=TILE, patch_size=PATCH)
    tc = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=560, max_position_embeddings=1024,
                                  rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                  tie_word_embeddings=False)
    cfg = transformers.Idefics3Config(vision_config=vc.to_dict(), text_config=tc.to_dict(), scale_factor=SCALE,
                                      image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(cfg)
    scale_weights(model)
    model.save_pretrained(out_dir)
    ip = transformers.Idefics3ImageProcessor(size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE},
                                             do_image_splitting=split)
    transformers.Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=TOKENS_PER_TILE).save_pretrained(out_dir)
    return out_dir


def hf_idefics3_greedy(model_dir: str, requests) -> tuple[list[Reference], list[list[int]]]:
    """``vlm_utils.hf_greedy`` with transformers' processor + Idefics3ForConditionalGeneration."""
    proc = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return hf_greedy(model, lambda text, images: proc(text=text, images=images or None, return_tensors="pt"), requests)
