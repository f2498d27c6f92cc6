"""Gemma 2 and Gemma 3 (text) over the Llama family's attention and MLP (models/llama.py).

What differs from Llama, and where it lives here:

* four norms per layer (the attention and feed-forward outputs are normed before the residual add);
* RMSNorm scales by ``1 + weight``: the loader adds the 1 once (in fp32, the same number the
  reference computes every step), so the shared :class:`RMSNorm` serves; llama.cpp's GGUF
  converter stores the sum already: the GGUF loader subtracts it (models/gguf/tensors.py), so a
  GGUF's tensors arrive as the HF checkpoint's;
* embeddings times ``sqrt(hidden)`` rounded to the model dtype; attention scale
  ``query_pre_attn_scalar ** -0.5``; GeGLU (``gelu_pytorch_tanh``);
* sliding-window layers by ``layer_types`` (Gemma 3: 5 local per global; Gemma 2: alternate), each
  kind with its own rope (Gemma 3's local layers use ``rope_local_base_freq``);
* Gemma 3: q/k norms; Gemma 2: tanh soft-capping of the attention scores and of the final logits.

Every layer's window is in ``args.layer_windows`` (the KV-cache side reads it there, as for Mistral).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asyncengine.errors import ConfigError
from asyncengine.layers.norm import RMSNorm
from asyncengine.layers.parallel import FULL, SINGLE, PPGroup, TPGroup, attention_shard, even_split
from asyncengine.layers.rotary import RotaryEmbedding, rope_parameters
from asyncengine.models.llama import MLP, Attention, LlamaArgs, LlamaForCausalLM, sliding_windows


@dataclass
class GemmaArgs(LlamaArgs):
    attn_scale: float | None = None  # the backends' score scale (query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    layer_ropes: tuple[dict, ...] = ()  # per layer: its rope parameters

    @classmethod
    def from_gemma(cls, cfg, max_positions: int, qk_norm: bool) -> "GemmaArgs":
        heads = cfg.num_attention_heads
        n = cfg.num_hidden_layers
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_layers=n, num_heads=heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, rms_norm_eps=cfg.rms_norm_eps,
            rope={}, max_positions=max_positions,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
            qkv_bias=bool(getattr(cfg, "attention_bias", False)), qk_norm=qk_norm,
            hidden_act=getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh"),
            layer_windows=sliding_windows(cfg),
            attn_scale=float(getattr(cfg, "query_pre_attn_scalar", None) or cfg.head_dim) ** -0.5,
            attn_softcap=getattr(cfg, "attn_logit_softcapping", None) or None,
            final_softcap=getattr(cfg, "final_logit_softcapping", None) or None,
            layer_ropes=tuple(_layer_rope(cfg, t) for t in types))


def _layer_rope(cfg, layer_type: str) -> dict:
    """The rope of one kind of layer: transformers 5 keys Gemma 3's by layer type; older configs
    (and Gemma 2) have one rope, Gemma 3's local layers then taking ``rope_local_base_freq``."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params.get(layer_type), dict):
        out = dict(params[layer_type])
    else:
        out = rope_parameters(cfg)
        local = getattr(cfg, "rope_local_base_freq", None)
        if layer_type == "sliding_attention" and local:
            out = {"rope_type": "default", "rope_theta": local}
    out.setdefault("rope_type", "default")
    out.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return out


class GemmaDecoderLayer(nn.Module):
    def __init__(self, a: GemmaArgs, tp: TPGroup, window: int | None, rope_index: int) -> None:
        super().__init__()
        self.self_attn = Attention(a, None, tp, window)
        self.self_attn.softcap = a.attn_softcap
        self.mlp = MLP(a, tp)
        self.rope_index = rope_index  # which of the model's ropes this layer's positions use
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(a.hidden_size, a.rms_norm_eps))

    def forward(self, x, rope, kv_cache, meta, residual=None):
        """As Llama's layer: returns (MLP output, residual), their sum made by the next norm's fused add."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual=residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual=residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    qk_norm = False
    # True for a checkpoint whose norm weights already hold the 1 (none today: the GGUF loader undoes it)
    norms_hold_one = False
    native_step_unsupported = "Gemma's layers (four norms, GeGLU, soft-capping) are not in the native step"

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE, pp: PPGroup = FULL) -> None:
        if pp.size > 1:
            raise ConfigError(f"{type(self).__name__}: pipeline parallel is not supported for Gemma yet")
        super().__init__(hf_config, max_positions, tp, pp)
        a = GemmaArgs.from_gemma(hf_config, max_positions, self.qk_norm)
        self.args = a
        keys = sorted({tuple(sorted(r.items())) for r in a.layer_ropes}, key=str)
        self.ropes = nn.ModuleList(RotaryEmbedding(a.head_dim, max_positions, dict(k)) for k in keys)
        self.rotary = self.ropes[0]
        index = [keys.index(tuple(sorted(r.items()))) for r in a.layer_ropes]
        self.layers = nn.ModuleList(GemmaDecoderLayer(a, tp, w, i) for w, i in zip(a.layer_windows, index))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    @classmethod
    def check_tensor_parallel(cls, hf_config, size: int) -> None:
        """Raise ConfigError, before any worker starts, if the model cannot be split ``size`` ways."""
        a = GemmaArgs.from_gemma(hf_config, 1, cls.qk_norm)
        tp = TPGroup(rank=0, size=size)
        attention_shard(a.num_heads, a.num_kv_heads, tp)
        even_split(a.intermediate_size, tp, "intermediate size")

    def forward(self, input_ids, positions, kv_caches, meta, intermediate=None):
        x = self.embed(input_ids)
        # sqrt(hidden) rounded to the activations' dtype first, as the reference does
        x = x * torch.tensor(self.args.hidden_size ** 0.5, dtype=x.dtype)
        ropes = [r.lookup(positions, x.dtype) for r in self.ropes]
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, ropes[layer.rope_index], kv, meta, residual)
        return self.norm(x) if residual is None else self.norm(x, residual=residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.args.final_softcap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def weight_targets(self, weights):
        """Llama's mapping, with the ``1 +`` of Gemma's norms added to the norm weights."""
        for name, target, shard, tensor in super().weight_targets(weights):
            if not self.norms_hold_one and target.endswith("norm.weight"):
                tensor = tensor.float() + 1.0
            yield name, target, shard, tensor


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    native_step_unsupported = "Gemma's layers (four norms, q/k norms, GeGLU) are not in the native step"


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text model of a Gemma 3 vision checkpoint (4B and larger): the vision tower and the
    projector are skipped; the language model's tensors are renamed to Gemma3ForCausalLM's
    (``language_model.model.X`` as saved, or ``model.language_model.X`` as transformers 5 names it
    in memory)."""

    def weight_targets(self, weights):
        return super().weight_targets(_text_weights(weights))


def _text_weights(weights):
    for name, tensor in weights:
        if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                            "model.multi_modal_projector.")):
            continue
        for old, new in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                         ("model.language_model.", "model.")):
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, tensor
