"""Mixture-of-experts GGUF files: Mixtral (written as ``llama`` with an expert count), ``qwen2moe``,
``qwen3moe`` and ``olmoe``, in Hugging Face's terms.

What llama.cpp's converter writes, and what llama.cpp assumes where it writes nothing:

* every expert of a layer in one 3-D tensor: ``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]``
  and ``ffn_down_exps`` ``[E, H, I]`` (torch order); each expert is a contiguous run of whole rows,
  so expert ``e`` of a quantized tensor is a byte slice of whole blocks (:func:`expert_names` names
  them ``mlp.experts.e.gate_proj.weight`` ..., the per-expert names the MoE models load);
* the router ``ffn_gate_inp`` ``[E, H]``; Qwen2-MoE's shared expert ``ffn_{gate,up,down}_shexp`` and
  its sigmoid gate ``ffn_gate_inp_shexp`` ``[1, H]``;
* ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length`` (Qwen's
  ``moe_intermediate_size``), ``expert_shared_feed_forward_length``. Whether the top-k weights are
  renormalised is not written: llama.cpp fixes it per architecture (Mixtral and Qwen3-MoE yes,
  Qwen2-MoE and OLMoE no), and so do we (``_RENORMALIZE``); every layer is sparse (no
  ``mlp_only_layers``); OLMoE has no ``clip_qkv``.

No torch here (a front end reads a file's config without it).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from asyncengine.errors import ModelLoadError

__all__ = ["MOE_ARCHITECTURES", "MOE_LAYER_NAMES", "expert_names", "expected_moe_shapes", "is_moe", "moe_kwargs"]

# GGUF architecture -> (transformers model_type, HF architecture); Mixtral is "llama" + expert_count
MOE_ARCHITECTURES = {
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
}
_MIXTRAL = ("mixtral", "MixtralForCausalLM")
_RENORMALIZE = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False}
# the field the model class reads the expert count from (models/moe.py's num_experts_field)
_COUNT_FIELD = {"mixtral": "num_local_experts", "qwen3_moe": "num_local_experts", "qwen2_moe": "num_experts",
                "olmoe": "num_experts"}
MOE_MODEL_TYPES = frozenset(_RENORMALIZE)

MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",  # stacked: expert_names() splits them
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")


def is_moe(model_type: str) -> bool:
    return model_type in MOE_MODEL_TYPES


def moe_kwargs(gguf_arch: str, model_type: str, key: Callable[..., Any], kwargs: dict[str, Any],
               path: str) -> tuple[str, str]:
    """Complete ``kwargs`` for a MoE file, in place; returns the (model_type, HF architecture),
    which for a ``llama`` file with experts becomes Mixtral."""
    n_experts = int(key("expert_count", 0) or 0)
    if gguf_arch == "llama" and n_experts == 0:
        return model_type, kwargs["architectures"][0]
    model_type, hf_arch = _MIXTRAL if gguf_arch == "llama" else MOE_ARCHITECTURES[gguf_arch]
    if n_experts < 1:
        raise ModelLoadError(f"{path}: a {gguf_arch} file needs '{gguf_arch}.expert_count' >= 1.")
    top_k = int(key("expert_used_count"))
    if not 1 <= top_k <= n_experts:
        raise ModelLoadError(f"{path}: expert_used_count {top_k} is not between 1 and expert_count {n_experts}.")
    kwargs.update(architectures=[hf_arch], num_experts_per_tok=top_k, norm_topk_prob=_RENORMALIZE[model_type],
                  output_router_logits=False, expert_linears=True)
    kwargs[_COUNT_FIELD[model_type]] = n_experts
    kwargs.pop("mlp_bias", None)
    if model_type == "mixtral":
        kwargs.update(sliding_window=None)
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        kwargs.update(moe_intermediate_size=int(key("expert_feed_forward_length", kwargs["intermediate_size"])),
                      decoder_sparse_step=1, mlp_only_layers=[])
        if model_type == "qwen2_moe":
            kwargs["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length", 0))
    else:  # olmoe
        kwargs.update(clip_qkv=None, attention_bias=False)
    return model_type, hf_arch


def expert_names(hf: str, n_experts: int) -> list[str] | None:
    """A stacked expert tensor's HF name -> the per-expert names, in expert order (None: not stacked)."""
    m = _STACKED.match(hf)
    if m is None:
        return None
    return [f"{m.group(1)}.{e}.{m.group(2)}.weight" for e in range(n_experts)]


def experts_of(config) -> int:
    return int(getattr(config, _COUNT_FIELD[config.model_type]))


def expected_moe_shapes(config, shapes: dict[str, tuple[int, ...]]) -> None:
    """Replace the dense MLP's shapes in ``shapes`` by the experts' (per expert), router and shared
    expert's, in place."""
    h, n = config.hidden_size, experts_of(config)
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        for leaf in ("gate_proj", "up_proj", "down_proj"):
            del shapes[f"{p}{leaf}.weight"]
        shapes[p + "gate.weight"] = (n, h)
        for e in range(n):
            shapes.update({f"{p}experts.{e}.gate_proj.weight": (inter, h), f"{p}experts.{e}.up_proj.weight": (inter, h),
                           f"{p}experts.{e}.down_proj.weight": (h, inter)})
        if shared:
            shapes.update({p + "shared_expert.gate_proj.weight": (shared, h), p + "shared_expert.up_proj.weight": (shared, h),
                           p + "shared_expert.down_proj.weight": (h, shared), p + "shared_expert_gate.weight": (1, h)})
