"""NVIDIA Nemotron-H: every layer is one mixer behind a pre-norm and a residual, the mixer being a
Mamba2 mixer (M), attention without positional encoding (*), or a squared-ReLU MLP (-).

HF names: ``model.embeddings``, ``model.layers.N.{norm,mixer}``, ``model.norm_f``, ``lm_head``.
Mixture-of-experts layers (E, Nemotron 3) are not built: such a checkpoint is refused when it loads.
"""
from __future__ import annotations

import torch
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.layers.linear import Linear
from asyncengine.layers.mamba2 import Mamba2Mixer
from asyncengine.layers.norm import RMSNorm
from asyncengine.layers.parallel import SINGLE, TPGroup
from asyncengine.models.hybrid import HybridAttention, HybridForCausalLM, mamba_shape_of


class ReluSquaredMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHBlock(nn.Module):
    def __init__(self, kind: str, mixer: nn.Module, hidden: int, eps: float, cache_index: int | None) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(hidden, eps)
        self.mixer = mixer
        self.cache_index = cache_index

    def forward(self, x, step):
        h = self.norm(x)
        if self.kind == "mamba":
            return x + self.mixer(h, step.ssm.states[self.cache_index], step.ssm)
        if self.kind == "attention":
            return x + self.mixer(h, step, step.kv_caches[self.cache_index])
        return x + self.mixer(h)


class NemotronHForCausalLM(HybridForCausalLM):
    hf_prefixes = ("model.", "backbone.")
    renames = {"embeddings": "embed_tokens", "norm_f": "norm"}

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(hf_config, max_positions, tp)
        c = hf_config
        eps = c.layer_norm_epsilon
        # transformers clamps dt from below at time_step_min (no upper limit) in this family
        self.mamba = mamba_shape_of(c, heads="mamba_num_heads", head_dim="mamba_head_dim", groups="n_groups",
                                    d_state="ssm_state_size", conv="conv_kernel", chunk="chunk_size",
                                    bias="use_bias", conv_bias="use_conv_bias", act="mamba_hidden_act", eps=eps,
                                    dt_limit=(getattr(c, "time_step_min", 0.0), float("inf")))
        if getattr(c, "mlp_hidden_act", "relu2") != "relu2":
            raise ModelLoadError(f"NemotronH MLP activation {c.mlp_hidden_act!r} is not supported (relu2)")
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        kv_index, state_index = self.number_layers(self.kinds)
        layers = []
        for i, kind in enumerate(self.kinds):
            if kind == "mamba":
                mixer, idx = Mamba2Mixer(self.mamba), state_index[i]
            elif kind == "attention":
                mixer = HybridAttention(c.hidden_size, heads, kv_heads, head_dim, bool(getattr(c, "attention_bias", False)),
                                        rotary_dim=0)
                idx = kv_index[i]
            elif kind == "mlp":
                mixer, idx = ReluSquaredMLP(c.hidden_size, c.intermediate_size, bool(getattr(c, "mlp_bias", False))), None
            else:
                raise ModelLoadError(f"NemotronH layer {i} is {kind!r}: mixture-of-experts layers are not supported yet")
            layers.append(NemotronHBlock(kind, mixer, c.hidden_size, eps, idx))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden_size, eps)
        self._finish_init(c, heads, kv_heads, head_dim)
