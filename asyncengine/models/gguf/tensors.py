"""A GGUF file's tensors back in Hugging Face's terms: names, row order, float values.

What llama.cpp's ``convert_hf_to_gguf.py`` changed, and what this module undoes:

* names: ``blk.N.attn_q.weight`` <- ``model.layers.N.self_attn.q_proj.weight`` and so on (``_LAYER_NAMES``);
* names differ by architecture: Gemma 2/3 have four norms per layer (``post_attention_norm``,
  ``ffn_norm`` = HF's ``pre_feedforward_layernorm``, ``post_ffw_norm``), Phi-3 keeps its fused
  ``attn_qkv`` and ``ffn_up`` (= ``gate_up_proj``, gate rows first);
* Gemma's norm weights were written with the ``1 +`` of its RMSNorm added: we subtract it (in fp32)
  so the tensors are the HF checkpoint's (:func:`norm_shift`);
* for the ``llama`` architecture only, the rows of ``q_proj`` and ``k_proj`` (weight and bias) were
  permuted per head, from HF's "rotate half" rope layout to GGML's interleaved pairs
  (``reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2)``). We apply the inverse, with the number of
  KV heads for ``k_proj``. Qwen2/Qwen3 use GGML's NEOX rope, so nothing was permuted there;
* weights are stored quantized: ``dequant.py`` turns them back to floats, or hands the CPU kernels'
  block formats over as they are. The permutation is over whole rows and the quantization blocks
  run along a row, so un-permuting after dequantizing (or on whole rows of blocks) is exact.

This module is the names, the row order and the checks; it imports no torch (a front end reads a
file's config and vocabulary without it).
"""

from __future__ import annotations

import re
import typing

import numpy as np

from asyncengine.errors import ModelLoadError
from asyncengine.models.gguf.moe import MOE_LAYER_NAMES, expected_moe_shapes, expert_names, is_moe

if typing.TYPE_CHECKING:
    from asyncengine.models.gguf.reader import GGUFFile

__all__ = ["EXTRA_TENSORS", "PERMUTED_QK_ARCHITECTURES", "check_tensor_names", "check_tensors", "hf_name",
           "hf_tensors", "norm_shift", "unpermute_rows"]

# Architectures whose q/k rows llama.cpp permuted for its interleaved ("normal") rope.
PERMUTED_QK_ARCHITECTURES = {"llama"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **MOE_LAYER_NAMES,  # experts, router, shared expert (gguf/moe.py)
}
# Per architecture, the names that differ from (or add to) the table above.
_ARCH_LAYER_NAMES = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
# Architectures whose converter stored RMSNorm weights as ``1 + weight`` (the HF checkpoint holds ``weight``).
NORM_PLUS_ONE_ARCHITECTURES = {"gemma2", "gemma3"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
# GGUF tensors kept under their own names in `extra_tensors` (they have no HF counterpart).
# (Llama 3's rope_freqs; Phi-3's LongRoPE factors, which config.py reads into the rope parameters)
EXTRA_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def hf_name(gguf_name: str, gguf_arch: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (names by ``gguf_arch``,
    the file's ``general.architecture``); None for a name with no HF counterpart (``rope_freqs.weight``,
    or a tensor of an architecture we do not know)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None:
        return None
    leaf = _ARCH_LAYER_NAMES.get(gguf_arch, {}).get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
    return None if leaf is None else f"model.layers.{m.group(1)}.{leaf}.{m.group(3)}"


def hf_tensors(f: GGUFFile, gguf_arch: str):
    """(HF name, tensor info, expert index or None, HF shape) of every model tensor of the file: a
    stacked expert tensor (``ffn_*_exps``, [E, ...]) is E entries, one per expert (gguf/moe.py)."""
    for t in f.tensors:
        hf = hf_name(t.name, gguf_arch)
        if hf is None:
            continue
        per = expert_names(hf, t.shape[0]) if len(t.shape) == 3 else None
        if per is None:  # (llama-quantize writes Qwen2-MoE's [1, H] shared expert gate as [H])
            yield hf, t, None, ((1, *t.shape) if hf.endswith(".shared_expert_gate.weight") and len(t.shape) == 1
                                else t.shape)
        else:
            for e, name in enumerate(per):
                yield name, t, e, t.shape[1:]


def norm_shift(gguf_arch: str, hf: str) -> float:
    """What to add to the stored tensor ``hf`` to get the HF checkpoint's: -1 for Gemma's norms."""
    return -1.0 if gguf_arch in NORM_PLUS_ONE_ARCHITECTURES and hf.endswith("norm.weight") else 0.0


def unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: ``hf = gguf[index]``."""
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of an even size")
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def check_tensor_names(f: GGUFFile, gguf_arch: str, path: str) -> None:
    """Refuse a file with a tensor we would not know what to do with (not a plain model of its architecture)."""
    unknown = [t.name for t in f.tensors if hf_name(t.name, gguf_arch) is None and t.name not in EXTRA_TENSORS]
    if unknown:
        raise ModelLoadError(
            f"{path}: {len(unknown)} tensor(s) have no known meaning for architecture {gguf_arch!r} "
            f"(e.g. {', '.join(unknown[:5])}); this file is not a plain {gguf_arch} model."
        )


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
    h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    bias = config.model_type in ("qwen2", "qwen2_moe") or getattr(config, "attention_bias", False)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.model_type in ("qwen3", "gemma3_text"):
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if config.model_type in ("gemma2", "gemma3_text"):
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)})
        if config.model_type == "phi3":  # q/k/v and gate/up fused, as the HF checkpoint holds them
            for part in ("q_proj", "k_proj", "v_proj"):
                del shapes[f"{p}self_attn.{part}.weight"]
            del shapes[p + "mlp.gate_proj.weight"], shapes[p + "mlp.up_proj.weight"]
            shapes.update({p + "self_attn.qkv_proj.weight": (q + 2 * kv, h), p + "mlp.gate_up_proj.weight": (2 * inter, h)})
        if config.model_type == "olmoe":  # q/k norms over the whole projection
            shapes.update({p + "self_attn.q_norm.weight": (q,), p + "self_attn.k_norm.weight": (kv,)})
        if config.model_type == "qwen3_moe":
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    if is_moe(config.model_type):
        expected_moe_shapes(config, shapes)
    return shapes


def check_tensors(config, tensors: dict, path: str) -> None:
    expected = _expected_shapes(config)
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ModelLoadError(
            f"{path}: {len(missing)} tensor(s) the {config.architectures[0]} config calls for are missing from "
            f"the file (e.g. {', '.join(missing[:4])})."
        )
    def shape(n):  # tensors, or their shapes
        return tuple(tensors[n]) if isinstance(tensors[n], tuple) else tuple(tensors[n].shape)

    wrong = [f"{n} is {list(shape(n))}, expected {list(s)}" for n, s in expected.items() if shape(n) != s]
    if wrong:
        raise ModelLoadError(f"{path}: tensor shapes do not match the metadata: {'; '.join(wrong[:4])}.")
