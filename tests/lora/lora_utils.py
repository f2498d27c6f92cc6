"""Tiny PEFT adapters for the LoRA tests: made with peft's get_peft_model (B randomly initialised, so
the adapter changes the output) and saved as PEFT saves them."""
from __future__ import annotations

import torch
import transformers

# (rank, alpha, target modules): three adapters of different ranks over different modules
ADAPTERS = {
    "a4": (4, 8, ["q_proj", "v_proj"]),
    "a8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "a16": (16, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def make_adapter(base_dir: str, out_dir: str, name: str, seed: int = 0) -> str:
    import peft

    rank, alpha, targets = ADAPTERS[name]
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                          lora_dropout=0.0)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():  # PEFT's random init is small; make the delta visible in greedy tokens
        for n, p in model.named_parameters():
            if "lora_B" in n or "lora_A" in n:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    model.save_pretrained(out_dir)
    return out_dir


def merged_model_dir(base_dir: str, adapter_dir: str, out_dir: str) -> str:
    """The reference: transformers + PEFT with the adapter merged into the base weights."""
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
    return out_dir
