"""Checkpoint tensors into our modules, for every model family: each tensor goes into a fused
Linear's part (q/k/v, gate/up) or into a plain parameter, and a checkpoint that leaves any of them
unfilled is an error, so a wrong checkpoint fails loudly instead of producing garbage output."""
from __future__ import annotations

import torch

from asyncengine.layers.linear import Linear
from asyncengine.layers.moe import SparseMoE


def load_tensor(model: torch.nn.Module, modules: dict, params: dict, name: str, target: str,
                shard: int | None, tensor) -> str:
    """Put checkpoint tensor ``name`` (a ``QuantizedTensor`` too) where ``target`` names it (part
    ``shard`` of a fused projection, or None); returns the key :func:`check_complete` counts."""
    mod_name, _, leaf = target.rpartition(".")
    layer = modules.get(mod_name)
    try:
        if isinstance(layer, Linear) and leaf in ("weight", "bias"):
            (layer.load if leaf == "weight" else layer.load_bias)(tensor, shard)
        elif isinstance(layer, SparseMoE) and leaf in ("w13", "w2") and shard is not None:
            layer.load_part(shard, tensor)  # one expert's gate/up/down (this rank's slice)
        elif target in params and shard is None:
            p = params[target]
            if p.shape != tensor.shape:
                raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor)
        else:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return f"{target}#{shard}"


def check_complete(modules: dict, params: dict, loaded: set[str]) -> None:
    """Every part of every Linear and every other parameter was loaded (keys of :func:`load_tensor`)."""
    expected = set()
    for n, m in modules.items():
        if isinstance(m, Linear):
            keys = [None] if len(m.parts) == 1 else range(len(m.parts))
            expected |= {f"{n}.weight#{k}" for k in keys}
            if m.bias is not None:
                expected |= {f"{n}.bias#{k}" for k in keys}
    linear = {f"{n}.{leaf}" for n, m in modules.items() if isinstance(m, Linear) for leaf in ("weight", "bias")}
    expected |= {f"{n}#None" for n in params if n not in linear}
    missing = sorted(expected - loaded)
    if missing:
        raise KeyError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
