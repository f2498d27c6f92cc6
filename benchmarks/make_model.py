#!/usr/bin/env python
"""Make the benchmark models: deterministic random-weight Hugging Face checkpoints (config,
safetensors, a byte-level BPE tokenizer trained on the Python standard library, a chat template).

    python benchmarks/make_model.py models/llama-bench                 # the 56M-parameter benchmark Llama
    python benchmarks/make_model.py models/llama-tiny --size tiny --arch qwen2

Random weights are rescaled to N(0, 1/fan_in) so logits are not near-uniform (transformers' 0.02
init makes every step a near-tie). Nothing is downloaded. Prints {"out", "arch", "size", "params"}.
"""
from __future__ import annotations

import argparse
import glob
import json
import os

SIZES = {
    # ~56M parameters: hidden 512, 8 layers, GQA 8 query / 4 KV heads, vocabulary 32000
    "bench": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=32000),
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096),
}
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def make_tokenizer(vocab_size: int):
    """A byte-level BPE trained on (deterministic) text that every Python install has."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                         show_progress=False))
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder to write the checkpoint into")
    ap.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    ap.add_argument("--size", default="bench", choices=sorted(SIZES))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[a.arch]
    cfg = cls(**SIZES[a.size], max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2,
              tie_word_embeddings=False)
    torch.manual_seed(a.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
    model.save_pretrained(a.out, safe_serialization=True)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=make_tokenizer(SIZES[a.size]["vocab_size"]),
                                                bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(a.out)
    print(json.dumps({"out": a.out, "arch": a.arch, "size": a.size,
                      "params": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()
