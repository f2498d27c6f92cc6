"""Bamba and Granite 4.0 hybrid (GraniteMoeHybrid): Llama-style decoder layers whose token mixer is
either attention or a Mamba2 mixer, each followed by a gated MLP.

Layer: ``h = x + mixer(input_layernorm(x))``, then ``h + mlp(norm(h))``. Bamba's rope covers half
of each head (``partial_rotary_factor``). Granite adds four scalars (embeddings x
``embedding_multiplier``, each residual branch x ``residual_multiplier``, the softmax scale
``attention_multiplier``, logits / ``logits_scaling``) and its MLP is one fused ``input_linear``
([gate | up]) and ``output_linear``; with ``num_local_experts > 0`` each MLP is a
:class:`~asyncengine.layers.moe.SparseMoE` (routed experts, top k of the logits softmaxed) whose
shared expert is that dense MLP.
"""
from __future__ import annotations

import re

from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.layers.activation import ActAndMul
from asyncengine.layers.linear import Linear
from asyncengine.layers.mamba2 import Mamba2Mixer
from asyncengine.layers.moe import SparseMoE
from asyncengine.layers.moe_router import RouterSpec
from asyncengine.layers.norm import RMSNorm
from asyncengine.layers.parallel import SINGLE, TPGroup
from asyncengine.layers.rotary import RotaryEmbedding, rope_parameters
from asyncengine.models.hybrid import HybridAttention, HybridForCausalLM, mamba_shape_of
from asyncengine.models.weight_loading import check_complete, load_tensor


class GatedMLP(nn.Module):
    """``down(act(gate) * up)``; ``names``: our (HF) names of the [gate | up] and down projections;
    ``split_in_checkpoint``: gate and up are two checkpoint tensors (Bamba), not one (Granite)."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool = False,
                 names: tuple[str, str] = ("gate_up_proj", "down_proj"), split_in_checkpoint: bool = True) -> None:
        super().__init__()
        self.up_name, self.down_name = names
        setattr(self, names[0], Linear(hidden, 2 * inter, bias=bias, parts=(inter, inter) if split_in_checkpoint else None))
        setattr(self, names[1], Linear(inter, hidden, bias=bias))
        self.act_and_mul = ActAndMul(act)

    def forward(self, x):
        return getattr(self, self.down_name)(self.act_and_mul(getattr(self, self.up_name)(x)))


class HybridDecoderLayer(nn.Module):
    def __init__(self, kind: str, mixer: nn.Module, mlp: nn.Module, hidden: int, eps: float,
                 post_norm_name: str, cache_index: int, residual_multiplier: float = 1.0) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_norm_name = post_norm_name
        setattr(self, post_norm_name, RMSNorm(hidden, eps))
        if kind == "mamba":
            self.mamba = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.cache_index = cache_index
        self.residual_multiplier = residual_multiplier

    def forward(self, x, step):
        h = self.input_layernorm(x)
        if self.kind == "mamba":
            h = self.mamba(h, step.ssm.states[self.cache_index], step.ssm)
        else:
            h = self.self_attn(h, step, step.kv_caches[self.cache_index])
        x = x + h * self.residual_multiplier if self.residual_multiplier != 1.0 else x + h
        h = self.mlp(getattr(self, self.post_norm_name)(x))
        return x + h * self.residual_multiplier if self.residual_multiplier != 1.0 else x + h


class BambaForCausalLM(HybridForCausalLM):
    renames = {"final_layernorm": "norm"}
    fused = {**HybridForCausalLM.fused, "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    mlp_names = ("gate_up_proj", "down_proj")
    mlp_attr = "feed_forward"
    post_norm_name = "pre_ff_layernorm"

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(hf_config, max_positions, tp)
        c = hf_config
        eps = c.rms_norm_eps
        self.mamba = mamba_shape_of(c, heads="mamba_n_heads", head_dim="mamba_d_head", groups="mamba_n_groups",
                                    d_state="mamba_d_state", conv="mamba_d_conv", chunk="mamba_chunk_size",
                                    bias="mamba_proj_bias", conv_bias="mamba_conv_bias", act="hidden_act", eps=eps)
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        rope = rope_parameters(c)
        rotary_dim = self.rotary_dim(c, head_dim, rope)
        if rotary_dim:
            self.rotary = RotaryEmbedding(head_dim, max_positions, rope)  # it rotates rope's partial factor itself
        kv_index, state_index = self.number_layers(self.kinds)
        layers = []
        for i, kind in enumerate(self.kinds):
            if kind == "mamba":
                mixer = Mamba2Mixer(self.mamba)
            elif kind == "attention":
                mixer = HybridAttention(c.hidden_size, heads, kv_heads, head_dim, bool(getattr(c, "attention_bias", False)),
                                        rotary_dim, self.attention_scale(c))
            else:
                raise ModelLoadError(f"{type(self).__name__}: layer {i} is {kind!r}, expected mamba or attention")
            mlp = self.make_mlp(c)
            layer = HybridDecoderLayer(kind, mixer, mlp, c.hidden_size, eps, self.post_norm_name,
                                       kv_index[i] if kind == "attention" else state_index[i],
                                       float(getattr(c, "residual_multiplier", 1.0)))
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden_size, eps)
        self._finish_init(c, heads, kv_heads, head_dim)

    # the HF name of each layer's MLP -> ours ("mlp")
    def _our_name(self, hf_name: str):
        return super()._our_name(hf_name.replace(f".{self.mlp_attr}.", ".mlp."))

    @staticmethod
    def rotary_dim(c, head_dim: int, rope: dict) -> int:
        return int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))

    @staticmethod
    def attention_scale(c) -> float | None:
        return None

    def make_mlp(self, c) -> nn.Module:
        return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, bool(getattr(c, "mlp_bias", False)),
                        self.mlp_names)


class GraniteMoeHybridForCausalLM(BambaForCausalLM):
    renames = {}
    fused = HybridForCausalLM.fused
    mlp_names = ("input_linear", "output_linear")
    mlp_attr = "shared_mlp"
    post_norm_name = "post_attention_layernorm"

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE) -> None:
        self.num_experts = int(getattr(hf_config, "num_local_experts", 0) or 0)
        self.embedding_multiplier = float(getattr(hf_config, "embedding_multiplier", 1.0))
        self.logits_scaling = float(getattr(hf_config, "logits_scaling", 1.0))
        super().__init__(hf_config, max_positions, tp)

    @staticmethod
    def rotary_dim(c, head_dim: int, rope: dict) -> int:
        return head_dim if getattr(c, "position_embedding_type", None) == "rope" else 0

    @staticmethod
    def attention_scale(c) -> float | None:
        return float(c.attention_multiplier)

    def make_mlp(self, c) -> nn.Module:
        shared = GatedMLP(c.hidden_size, c.shared_intermediate_size, c.hidden_act, False, self.mlp_names,
                          split_in_checkpoint=False)
        if not self.num_experts:
            return shared
        # routed experts (top k of the logits, softmax over those k) plus the always-on shared MLP
        spec = RouterSpec(self.num_experts, c.num_experts_per_tok, "topk_softmax")
        return SparseMoE(c.hidden_size, c.intermediate_size, spec, c.hidden_act, shared=shared)

    def _our_name(self, hf_name: str):
        if self.num_experts:
            hf_name = hf_name.replace(".shared_mlp.", ".mlp.shared_expert.").replace(
                ".block_sparse_moe.router.layer.", ".mlp.gate.")
        return super()._our_name(hf_name)

    def load_weights(self, weights) -> None:
        """As every hybrid's, but a layer's stacked experts (``block_sparse_moe.input_linear``
        [E, 2I, H], ``output_linear`` [E, H, I]) go to its :class:`SparseMoE` whole."""
        if not self.num_experts:
            return super().load_weights(weights)
        stacked: dict[str, dict[str, object]] = {}

        def rest():
            for name, tensor in weights:
                m = _STACKED.search(name)
                if m is None:
                    yield name, tensor
                else:
                    stacked.setdefault(m.group(1), {})[m.group(2)] = tensor

        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, target, shard, tensor in self.weight_targets(rest()):
            loaded.add(load_tensor(self, modules, params, hf_name, target, shard, tensor))
        for i, parts in stacked.items():
            moe = modules[f"layers.{i}.mlp"]
            moe.load_stacked(parts["input_linear"], parts["output_linear"])
        for prefix, moe in modules.items():
            if isinstance(moe, SparseMoE):
                if moe.missing():
                    raise KeyError(f"checkpoint is missing the experts of {prefix}")
                loaded |= {f"{prefix}.w13#None", f"{prefix}.w2#None"}
        check_complete(modules, params, loaded)


_STACKED = re.compile(r"layers\.(\d+)\.block_sparse_moe\.(input_linear|output_linear)\.weight$")
