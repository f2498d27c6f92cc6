"""NVIDIA Nemotron-H: every layer is one mixer behind a pre-norm and a residual, the mixer being a
Mamba2 mixer (M), attention without positional encoding (*), or a squared-ReLU MLP (-).

HF names: ``model.embeddings``, ``model.layers.N.{norm,mixer}``, ``model.norm_f``, ``lm_head``.
Mixture-of-experts layers (E, Nemotron 3): a :class:`SparseMoE` of squared-ReLU experts without a
gate, a sigmoid router with a selection bias over expert groups, and squared-ReLU shared experts;
a latent projection (``moe_latent_size``) is refused.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.layers.linear import Linear
from asyncengine.layers.mamba2 import Mamba2Mixer
from asyncengine.layers.moe import SparseMoE
from asyncengine.layers.moe_router import RouterSpec
from asyncengine.layers.norm import RMSNorm
from asyncengine.layers.parallel import SINGLE, TPGroup
from asyncengine.models.hybrid import HybridAttention, HybridForCausalLM, mamba_shape_of
from asyncengine.models.weight_loading import check_complete, load_tensor


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
            elif kind == "moe":
                mixer, idx = self.make_moe(c), None
            else:
                raise ModelLoadError(f"NemotronH layer {i} is {kind!r}, expected mamba, attention, mlp or moe")
            layers.append(NemotronHBlock(kind, mixer, c.hidden_size, eps, idx))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden_size, eps)
        self._finish_init(c, heads, kv_heads, head_dim)

    @staticmethod
    def make_moe(c) -> SparseMoE:
        if getattr(c, "moe_latent_size", None) is not None:
            raise ModelLoadError("NemotronH MoE with a latent projection (moe_latent_size) is not supported")
        spec = RouterSpec(c.n_routed_experts, c.num_experts_per_tok, "sigmoid", bool(c.norm_topk_prob),
                          num_groups=c.n_group, topk_groups=c.topk_group, scale=float(c.routed_scaling_factor))
        bias = bool(getattr(c, "mlp_bias", False))
        shared = ReluSquaredMLP(c.hidden_size, c.moe_shared_expert_intermediate_size, bias)
        return SparseMoE(c.hidden_size, c.moe_intermediate_size, spec, "relu2", router_bias=True, shared=shared,
                         gated=False)

    def _our_name(self, hf_name: str):
        hf_name = hf_name.replace(".gate.e_score_correction_bias", ".e_score_correction_bias")
        return super()._our_name(hf_name.replace(".shared_experts.", ".shared_expert."))

    def load_weights(self, weights) -> None:
        """As every hybrid's, but each expert's up/down tensor goes to its layer's :class:`SparseMoE`."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())

        def rest():
            for name, tensor in weights:
                m = _EXPERT.search(name)
                if m is None:
                    yield name, tensor
                else:
                    modules[f"layers.{m.group(1)}.mixer"].load_expert(int(m.group(2)), m.group(3).removesuffix("_proj"),
                                                                      tensor, False)

        loaded = {load_tensor(self, modules, params, *t) for t in self.weight_targets(rest())}
        for prefix, moe in modules.items():
            if isinstance(moe, SparseMoE):
                if moe.missing():
                    raise KeyError(f"checkpoint is missing {moe.missing()[:3]} of {prefix}")
                loaded |= {f"{prefix}.w13#None", f"{prefix}.w2#None"}
        check_complete(modules, params, loaded)


_EXPERT = re.compile(r"layers\.(\d+)\.mixer\.experts\.(\d+)\.(up_proj|down_proj)\.weight$")
