"""Mamba2ForCausalLM: a stack of Mamba2 mixers, no attention at all (state-spaces/mamba2-*).

Each layer is ``x + mixer(norm(x))``; the model keeps no KV cache, only a state slot per request
(so its decode cost does not grow with the context). HF names: ``backbone.embeddings``,
``backbone.layers.N.{norm,mixer}``, ``backbone.norm_f``, ``lm_head``.
"""
from __future__ import annotations

from torch import nn

from asyncengine.layers.mamba2 import Mamba2Mixer
from asyncengine.layers.norm import RMSNorm
from asyncengine.layers.parallel import SINGLE, TPGroup
from asyncengine.models.hybrid import HybridForCausalLM, mamba_shape_of


class Mamba2Layer(nn.Module):
    kind = "mamba"

    def __init__(self, shape, eps: float, state_index: int) -> None:
        super().__init__()
        self.norm = RMSNorm(shape.hidden_size, eps)
        self.mixer = Mamba2Mixer(shape)
        self.state_index = state_index

    def forward(self, x, step):
        return x + self.mixer(self.norm(x), step.ssm.states[self.state_index], step.ssm)


class Mamba2ForCausalLM(HybridForCausalLM):
    hf_prefixes = ("backbone.",)
    renames = {"embeddings": "embed_tokens", "embedding": "embed_tokens", "norm_f": "norm"}

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(hf_config, max_positions, tp)
        c = hf_config
        eps = c.layer_norm_epsilon
        self.mamba = mamba_shape_of(c, heads="num_heads", head_dim="head_dim", groups="n_groups",
                                    d_state="state_size", conv="conv_kernel", chunk="chunk_size", bias="use_bias",
                                    conv_bias="use_conv_bias", act="hidden_act", eps=eps)
        self.layers = nn.ModuleList(Mamba2Layer(self.mamba, eps, i) for i in range(len(self.kinds)))
        self.norm = RMSNorm(c.hidden_size, eps)
        # no attention layers: the (empty) KV cache's head shape is a placeholder
        self._finish_init(c, num_heads=1, num_kv_heads=1, head_dim=8)
