"""Tensor parallel for the Transformers backend, from the model's own ``base_model_tp_plan``.

transformers declares, per model, which of its ``nn.Linear`` layers split by output features
("colwise": q/k/v, gate/up) and which by input features ("rowwise": o_proj, down_proj, whose
partial sums one all-reduce completes). We apply the plan to the model built on the meta device:
each planned Linear is replaced by one of 1/N the size, and :func:`weight_shard` tells the loader
which slice of each checkpoint tensor the rank reads. Attention needs nothing more: transformers
reshapes projections into ``(-1, head_dim)`` heads, so a rank holding whole heads runs unchanged.

Only plain "colwise"/"rowwise" entries on Linear layers are applied (a replicated embedding for
"embedding_rowwise"); a model without a plan, or with another style (Olmo 2's
"colwise_gather_output"), is refused with the reason."""
from __future__ import annotations

import re

import torch
from torch import nn
from torch.nn import functional as F

from asyncengine.errors import ConfigError
from asyncengine.layers.parallel import TPGroup

APPLIED = ("colwise", "rowwise")
REPLICATED = ("embedding_rowwise",)  # the embedding stays whole on every rank


def tp_plan(cfg, size: int) -> dict[str, str]:
    """The config's plan as {module regex: style}; ConfigError if the model cannot be split ``size`` ways."""
    arch = (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0]
    plan = dict(getattr(cfg, "base_model_tp_plan", None) or {})
    if not plan:
        raise ConfigError(f"{arch} through the Transformers backend: tensor_parallel_size > 1 needs the model's "
                          "base_model_tp_plan, and this model has none")
    odd = sorted({s for s in plan.values() if s not in APPLIED + REPLICATED})
    if odd:
        raise ConfigError(f"{arch} through the Transformers backend: its tensor-parallel plan uses {odd}; only "
                          f"{list(APPLIED)} are supported")
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    for what, n in (("attention heads", heads), ("KV heads", kv), ("intermediate size", cfg.intermediate_size)):
        if n % size:
            raise ConfigError(f"{arch} through the Transformers backend: {n} {what} do not split "
                              f"{size} ways (tensor_parallel_size)")
    return {_regex(k): v for k, v in plan.items() if v in APPLIED}


def _regex(pattern: str) -> str:
    return "(?:.*\\.)?" + re.escape(pattern).replace("\\*", "\\d+") + "$"


def style_of(plan: dict[str, str], module_name: str) -> str | None:
    return next((s for rx, s in plan.items() if re.match(rx, module_name)), None)


class RowParallelLinear(nn.Linear):
    """This rank's input-feature slice; the bias is added once, after the all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def shard_modules(model: nn.Module, plan: dict[str, str], tp: TPGroup) -> None:
    """Replace every planned Linear by this rank's 1/N of it (on the current device: meta)."""
    for name, module in list(model.named_modules()):
        style = style_of(plan, name)
        if style is None or not isinstance(module, nn.Linear):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        bias = module.bias is not None
        if style == "colwise":
            new = nn.Linear(module.in_features, module.out_features // tp.size, bias=bias)
        else:
            new = RowParallelLinear(module.in_features // tp.size, module.out_features, bias, tp)
        setattr(parent, leaf, new)


def weight_shard(plan: dict[str, str], tp: TPGroup, name: str, local_shape: tuple[int, ...]):
    """``(dim, start, stop)`` of checkpoint tensor ``name`` (the model's naming) this rank reads, or
    None for a whole one; ``local_shape``: the rank's parameter (1/N of the full one along dim)."""
    module_name, _, leaf = name.rpartition(".")
    style = style_of(plan, module_name)
    if style is None or (style == "rowwise" and leaf == "bias"):
        return None
    dim = 0 if style == "colwise" else 1
    per = local_shape[dim]
    return dim, tp.rank * per, (tp.rank + 1) * per
