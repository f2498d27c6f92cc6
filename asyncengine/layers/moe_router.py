"""Top-k expert routing: which experts each token goes to, and with what weight.

The families differ only in the order of three steps, so one function serves them all, selected by
a :class:`RouterSpec` built from the checkpoint's config:

- ``softmax_topk`` (Mixtral, Qwen2/3-MoE, OLMoE): softmax over all experts, keep the top k, and
  renormalise those k to sum to one only where the config says so (``norm_topk_prob``; Mixtral
  always does);
- ``topk_softmax`` (Granite MoE): top k of the raw logits, softmax over those k;
- ``sigmoid`` (DeepSeek-V3, Nemotron-H): a sigmoid score per expert, the top k picked on score + a
  learned bias (the bias chooses, it never weighs) among the ``topk_groups`` best of
  ``num_groups`` expert groups (a group scores the sum of its best two), optionally renormalised.

Every kind's weights are then multiplied by ``scale`` (``routed_scaling_factor``).

Routing runs in fp32 whatever the activations are, as transformers does, so a bf16 model picks the
same experts as its reference more often.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncengine.errors import ConfigError

ROUTER_KINDS = ("softmax_topk", "topk_softmax", "sigmoid")


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    kind: str = "softmax_topk"
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ROUTER_KINDS:
            raise ConfigError(f"router kind {self.kind!r}: expected one of {', '.join(ROUTER_KINDS)}")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ConfigError(f"{self.num_experts} experts in {self.num_groups} groups, top {self.topk_groups} groups")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.top_k} must be between 1 and the {self.num_experts} experts")


def route(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [tokens, experts] -> (weights [tokens, k] fp32, expert ids [tokens, k] int64)."""
    logits = logits.float()
    if spec.kind == "topk_softmax":
        top, ids = logits.topk(spec.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    elif spec.kind == "sigmoid":
        scores = torch.sigmoid(logits)
        choose = scores if bias is None else scores + bias.float()
        if spec.num_groups > 1:
            groups = choose.view(-1, spec.num_groups, spec.num_experts // spec.num_groups)
            best = groups.topk(2, dim=-1).values.sum(-1).topk(spec.topk_groups, dim=-1).indices
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choose = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, spec.num_experts)
        ids = choose.topk(spec.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    else:
        weights, ids = torch.softmax(logits, dim=-1).topk(spec.top_k, dim=-1)
    if spec.renormalize and spec.kind != "topk_softmax":  # (a softmax over the k already sums to one)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * spec.scale if spec.scale != 1.0 else weights), ids
