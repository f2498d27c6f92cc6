"""Tiny random HF models and tokenizers, written as GGUF the way llama.cpp's convert_hf_to_gguf does.

    model = tiny_hf_model("llama")                     # LlamaForCausalLM, hidden 64, 2 layers, vocab = tokenizer's
    tok = tiny_tokenizer()                             # byte-level BPE (tokenizers.Tokenizer), ChatML specials
    write_tiny_gguf(tmp_path / "m.gguf", model, tok, qtype="Q8_0")

The writer is independent of asyncengine's loader (its own name table, its own q/k permutation), so
tests can check the loader against it. Architectures: llama, qwen2, qwen3, gemma2, gemma3 (norms
stored as ``1 + weight``, the converter's metadata: soft-caps, sliding window, local rope base) and
phi3 (fused ``attn_qkv`` / ``ffn_up``, partial rotary, LongRoPE factor tensors). Only numpy/gguf/torch/transformers/tokenizers are used.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you today?",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join a running batch.",
    "asyncio tasks await tokens streamed from the engine, 1 2 3 4 5 6 7 8 9 0.",
    "def main():\n    print('hello')\n    return 42\n",
    "Numbers like 2024 and 3.14159 are split into single digits.",
] * 4

_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# where llama.cpp's tensor map names a layer tensor otherwise for an architecture
_HF_TO_GGUF_ARCH = {
    "gemma2": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
_HF_TO_GGUF_ARCH["gemma3"] = _HF_TO_GGUF_ARCH["gemma2"]
_GGUF_ARCH = {"gemma3_text": "gemma3"}  # transformers model_type -> general.architecture
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE trained on a few sentences, SmolLM-style (digits split one by one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return tok


def tiny_hf_model(arch: str = "llama", vocab_size: int = 320, seed: int = 0, **overrides):
    """A small random model with weights scaled so its logits are far from flat."""
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    common.update(overrides)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
    elif arch == "qwen3":
        common.setdefault("head_dim", 32)  # deliberately != hidden / heads
        config = transformers.Qwen3Config(**common)
    elif arch in ("gemma2", "gemma3"):
        # query_pre_attn_scalar = head_dim: a GGUF does not record it (llama.cpp's rule; not a 27B);
        # layer_types by transformers' default: Gemma 2 alternates, Gemma 3 has 5 sliding per global
        common.update(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True)
        if arch == "gemma2":
            common.update(attn_logit_softcapping=5.0, final_logit_softcapping=8.0)
            config = transformers.Gemma2Config(**common)
        else:
            common["num_hidden_layers"] = overrides.get("num_hidden_layers", 6)  # 5 sliding, 1 global
            common["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
            config = transformers.Gemma3TextConfig(**common)
            config.layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                  for i in range(config.num_hidden_layers)]
    elif arch == "phi3":  # Phi-4-mini's partial rotary (3/4 of each head), LongRoPE
        common.update(partial_rotary_factor=0.75, original_max_position_embeddings=128, max_position_embeddings=1024,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                       "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                       "long_factor": [2.0 + 0.5 * i for i in range(6)]})
        config = transformers.Phi3Config(**common)
    else:
        raise ValueError(arch)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
            elif name.endswith("norm.weight"):  # (Gemma scales by 1 + weight)
                p.uniform_(-0.5, 0.5) if arch.startswith("gemma") else p.uniform_(0.5, 1.5)
            else:  # biases
                p.normal_(0.0, 0.1)
    return model.eval()


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.generate_extra_tensors for rope_type llama3."""
    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    parts = hf_name.split(".")
    assert parts[:2] == ["model", "layers"], hf_name
    layer, leaf, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{_HF_TO_GGUF_ARCH.get(arch, {}).get(leaf) or _HF_TO_GGUF_LAYER[leaf]}.{kind}"


def _arch_metadata(w: gguf.GGUFWriter, arch: str, cfg, head_dim: int) -> dict[str, np.ndarray]:
    """What convert_hf_to_gguf's Gemma2Model / Gemma3Model / Phi3MiniModel write beyond the common
    keys; returns the extra tensors (Phi-3's LongRoPE factors)."""
    if arch in ("gemma2", "gemma3"):
        if arch == "gemma2":
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        else:
            rope = cfg.rope_parameters
            w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
            if cfg.final_logit_softcapping:
                w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
        return {}
    if arch != "phi3":
        return {}
    rope = cfg.rope_parameters
    original = rope.get("original_max_position_embeddings", cfg.original_max_position_embeddings)
    rotary = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_dimension_count(rotary)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(cfg.sliding_window or 0)
    if not rope.get("long_factor"):
        return {}
    scale = cfg.max_position_embeddings / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    return {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}


def _tokenizer_metadata(tok) -> dict:
    import json

    model = json.loads(tok.to_str())["model"]
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [None] * len(vocab)
    for text, idx in vocab.items():
        tokens[idx] = text
    assert None not in tokens
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    return {"tokens": tokens, "merges": merges, "types": types}


def write_tiny_gguf(
    out_path: str | os.PathLike,
    model: transformers.PreTrainedModel | str | os.PathLike,
    tokenizer=None,
    qtype: str = "F32",
    *,
    pre: str = "smollm",
    chat_template: str | None = CHATML_TEMPLATE,
    name: str = "tiny-test-model",
    tensor_overrides: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
    tensor_qtypes: dict[str, str] | None = None,
) -> Path:
    """Write ``model`` (an HF model or a folder to load one from) as a GGUF at ``out_path``.

    2-D weights are stored as ``qtype`` (F32, F16, BF16, a type gguf-py can quantize: Q8_0, Q4_0,
    Q4_1, Q5_0, Q5_1, or a K-quant, by :func:`quantize_k`: Q4_K, Q5_K, Q6_K); 1-D tensors stay F32
    as llama.cpp keeps them. ``tokenizer`` is a ``tokenizers.Tokenizer`` (or None for no tokenizer
    metadata). ``tensor_overrides`` replaces or adds tensors by GGUF name with raw (array, type)
    pairs, for writing deliberately odd files. ``tensor_qtypes`` stores the named 2-D tensors (GGUF
    names) in another type than ``qtype`` (a Q4_K_M-like mix).
    """
    if not isinstance(model, torch.nn.Module):
        model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    cfg = model.config
    arch = _GGUF_ARCH.get(cfg.model_type, cfg.model_type)
    assert arch in ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"), arch
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = dict(cfg.rope_parameters)

    out_path = Path(out_path)
    w = gguf.GGUFWriter(out_path, arch)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if arch in ("llama", "qwen2", "qwen3"):
        w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads or arch in ("qwen3", "gemma2", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0
                    if qtype not in K_QUANTS else gguf.LlamaFileType.MOSTLY_Q4_K_M)

    if tokenizer is not None:
        meta = _tokenizer_metadata(tokenizer)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(meta["tokens"])
        w.add_token_types(meta["types"])
        w.add_token_merges(meta["merges"])
        w.add_bos_token_id(meta["tokens"].index("<|im_start|>"))
        w.add_eos_token_id(meta["tokens"].index("<|im_end|>"))
        w.add_pad_token_id(meta["tokens"].index("<|im_end|>"))
        w.add_add_bos_token(False)
        if chat_template is not None:
            w.add_chat_template(chat_template)

    tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] = {}
    for gname, data in _arch_metadata(w, arch, cfg, head_dim).items():
        tensors[gname] = (data, gguf.GGMLQuantizationType.F32)
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = (llama3_rope_freqs(rope, head_dim), gguf.GGMLQuantizationType.F32)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().to(torch.float32).numpy().copy()
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            n_kv = cfg.num_attention_heads if ".q_proj." in hf_name else cfg.num_key_value_heads
            data = llama_permute(data, cfg.num_attention_heads, n_kv)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # the converter stores Gemma's 1 + weight
        gname = _gguf_name(hf_name, arch)
        t = gguf.GGMLQuantizationType[(tensor_qtypes or {}).get(gname, qtype)]
        tensors[gname] = (data, t if data.ndim == 2 else gguf.GGMLQuantizationType.F32)
    tensors.update(tensor_overrides or {})

    for gname, (data, t) in tensors.items():
        if data.dtype == np.uint8:  # already raw bytes of type t
            w.add_tensor(gname, data, raw_dtype=t)
        elif t == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, data.astype(np.float32))
        elif t == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, data.astype(np.float16))
        elif t.name in K_QUANTS:  # gguf-py has no K-quant quantizer: ours (quantize_k)
            w.add_tensor(gname, quantize_k(data, t.name), raw_dtype=t)
        else:
            w.add_tensor(gname, gguf.quants.quantize(data, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def quantized_reference(tensor: torch.Tensor, qtype: str) -> torch.Tensor:
    """What a 2-D HF tensor becomes after a quantize/dequantize round trip of ``qtype``.

    Quantization blocks run along rows and the llama permutation moves whole rows, so this equals
    the loader's output for permuted q/k tensors too.
    """
    qt = gguf.GGMLQuantizationType[qtype]
    data = tensor.detach().to(torch.float32).numpy()
    if qtype == "F32":
        return torch.from_numpy(data.copy())
    if qtype == "F16":
        return torch.from_numpy(data.astype(np.float16).astype(np.float32))
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qt), qt).reshape(data.shape).copy())


K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _k4_pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 6-bit scales and mins per super-block -> llama.cpp's 12 bytes (get_scale_min_k4's inverse)."""
    out = np.zeros(sc.shape[:-1] + (12,), dtype=np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    return out


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(v.shape[:-1] + (2,))


def quantize_k(data: np.ndarray, qtype: str) -> np.ndarray:
    """A 2-D float array (columns a multiple of 256) as valid ``qtype`` K-quant blocks, uint8
    ``[rows, cols // 256 * block_bytes]``: a plain min/max encoding in llama.cpp's block layout
    (``block_q4_K`` / ``block_q5_K`` / ``block_q6_K``), not its search for the best scales; what the
    tests need is a valid file whose dequantized values the kernels must reproduce."""
    rows, cols = data.shape
    x = data.astype(np.float32).reshape(rows, cols // 256, 256)
    if qtype == "Q6_K":
        sub = x.reshape(rows, -1, 16, 16)
        scale = np.abs(sub).max(-1) / 31  # per 16 values
        d = np.maximum(scale.max(-1, keepdims=True), 1e-8) / 127
        d = d.astype(np.float16).astype(np.float32)
        sc = np.clip(np.round(scale / d), 1, 127)
        q = np.clip(np.round(sub / (d[..., None] * sc[..., None])), -32, 31).astype(np.int32) + 32
        q = q.reshape(rows, -1, 256)
        ql = np.zeros((rows, q.shape[1], 128), np.uint8)
        qh = np.zeros((rows, q.shape[1], 64), np.uint8)
        for h in range(2):
            v = q[..., 128 * h:128 * h + 128]
            a, b, c, e = v[..., 0:32], v[..., 32:64], v[..., 64:96], v[..., 96:128]
            ql[..., 64 * h:64 * h + 32] = (a & 15) | ((c & 15) << 4)
            ql[..., 64 * h + 32:64 * h + 64] = (b & 15) | ((e & 15) << 4)
            qh[..., 32 * h:32 * h + 32] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
        blocks = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=-1)
        return blocks.reshape(rows, -1)
    top = 15 if qtype == "Q4_K" else 31
    sub = x.reshape(rows, -1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / top
    d = (np.maximum(scale.max(-1, keepdims=True), 1e-8) / 63).astype(np.float16).astype(np.float32)
    dmin = (np.maximum((-lo).max(-1, keepdims=True), 1e-8) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d), 1, 63).astype(np.int32)
    mn = np.clip(np.round(-lo / dmin), 0, 63).astype(np.int32)
    q = np.round((sub + (dmin * mn)[..., None]) / (d * sc)[..., None])
    q = np.clip(q, 0, top).astype(np.int32).reshape(rows, -1, 256)
    qs = np.zeros((rows, q.shape[1], 128), np.uint8)
    qh = np.zeros((rows, q.shape[1], 32), np.uint8)
    for g in range(4):
        a, b = q[..., 64 * g:64 * g + 32], q[..., 64 * g + 32:64 * g + 64]
        qs[..., 32 * g:32 * g + 32] = (a & 15) | ((b & 15) << 4)
        qh |= (((a >> 4) & 1) << (2 * g) | ((b >> 4) & 1) << (2 * g + 1)).astype(np.uint8)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _k4_pack_scales(sc.astype(np.uint8), mn.astype(np.uint8))]
    parts += [qh, qs] if qtype == "Q5_K" else [qs]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def dense_reference_dir(tmp_path, hf_model, weights: dict[str, torch.Tensor]) -> str:
    """A safetensors checkpoint of ``hf_model``'s architecture holding ``weights`` (HF names)."""
    model = transformers.AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    d = tmp_path / "reference"
    model.save_pretrained(d)
    return str(d)
