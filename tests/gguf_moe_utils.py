"""Tiny random mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) written as GGUF by
llama.cpp's own tools: ``convert_hf_to_gguf.py`` (F32/F16/Q8_0) and ``llama-quantize`` (Q4_0,
Q4_K_M...), from /work/peers/llama.cpp or ``$LLAMA_CPP_DIR``.

    model = tiny_moe_model("qwen3_moe", vocab_size=320)
    path = convert_to_gguf(model, tiny_tokenizer(), tmp_path, "f32")     # pytest.skip if no converter
    q4 = llama_quantize(path, tmp_path / "q4.gguf", "Q4_0")               # pytest.skip if no binary
    ref = hf_model_with(model, load_gguf(q4).tensors)                      # transformers on the file's values

The converter refuses a tokenizer whose pre-tokenizer hash it does not know; ours is SmolLM-style,
so the conversion runs with ``get_vocab_base_pre`` answering "smollm" (nothing else is changed).
"""
from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

LLAMA_CPP = Path(os.environ.get("LLAMA_CPP_DIR", "/work/peers/llama.cpp"))
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

_CONVERT = """
import runpy, sys
sys.path.insert(0, {root!r})
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


def tiny_moe_model(arch: str, vocab_size: int = 320, seed: int = 0, hidden: int = 64, inter: int = 128,
                   experts: int = 4, top_k: int = 2):
    """A 2-layer random MoE of ``arch`` (a transformers model_type), weights scaled so that its
    logits are far from flat and the router picks clear winners."""
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  num_experts_per_tok=top_k)
    if arch == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=experts)
    elif arch == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**common, num_experts=experts, moe_intermediate_size=inter // 2,
                                             shared_expert_intermediate_size=inter, norm_topk_prob=False)
    elif arch == "qwen3_moe":  # llama.cpp always renormalises Qwen3-MoE's top k (as its checkpoints say)
        config = transformers.Qwen3MoeConfig(**common, head_dim=32, num_experts=experts, moe_intermediate_size=inter,
                                             norm_topk_prob=True)
    elif arch == "olmoe":
        config = transformers.OlmoeConfig(**common, num_experts=experts, norm_topk_prob=False)
    else:
        raise ValueError(arch)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


def convert_to_gguf(model, tokenizer, out_dir: Path, outtype: str = "f32") -> Path:
    """``model`` saved with ``save_pretrained`` and converted by llama.cpp's converter (``outtype``:
    f32, f16, bf16, q8_0)."""
    script = LLAMA_CPP / "convert_hf_to_gguf.py"
    if not script.exists():
        pytest.skip(f"llama.cpp's converter is absent ({script})")
    src = Path(out_dir) / f"{model.config.model_type}-hf"
    if not (src / "config.json").exists():
        model.save_pretrained(src)
        transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(src)
    out = Path(out_dir) / f"{model.config.model_type}-{outtype}.gguf"
    run = subprocess.run([sys.executable, "-c", _CONVERT.format(root=str(LLAMA_CPP), script=str(script)), str(src),
                          "--outfile", str(out), "--outtype", outtype], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def llama_quantize(src: Path, dst: Path, qtype: str) -> Path:
    """llama.cpp's ``llama-quantize src dst qtype`` (Q4_0, Q8_0, Q4_K_M...)."""
    binary = LLAMA_CPP / "build" / "bin" / "llama-quantize"
    if not binary.exists():
        pytest.skip(f"llama.cpp's llama-quantize is absent ({binary})")
    run = subprocess.run([str(binary), str(src), str(dst), qtype, "1"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return Path(dst)


def hf_model_with(model, tensors: dict[str, torch.Tensor]):
    """A copy of the transformers ``model`` holding ``tensors`` (``load_gguf``'s HF names, one
    tensor per expert), the experts stacked as transformers 5 holds them."""
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    stacked: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    with torch.no_grad():
        for name, t in tensors.items():
            parts = name.split(".")
            if ".mlp.experts." in name:
                prefix = ".".join(parts[:parts.index("experts") + 1])
                stacked.setdefault(prefix, {}).setdefault(int(parts[-3]), {})[parts[-2]] = t
            else:
                params[name].copy_(t)
        for prefix, experts in stacked.items():
            n = len(experts)
            params[prefix + ".gate_up_proj"].copy_(torch.stack(
                [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in range(n)]))
            params[prefix + ".down_proj"].copy_(torch.stack([experts[e]["down_proj"] for e in range(n)]))
    return ref
