"""A PEFT LoRA adapter read from its folder (adapter_config.json + adapter_model.safetensors) and
checked against the base model's layer shapes before it may touch a slot: a hostile or mismatched
adapter fails here with a ConfigError, never mid-step."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncengine.config.lora import LORA_KEY as _KEY, TARGETS, check_adapter_files
from asyncengine.errors import ConfigError

@dataclass
class LoRAAdapter:
    """One adapter in host memory: per (layer, module) its A [r, in] and B [out, r], B already
    multiplied by the scale (alpha / r, or alpha / sqrt(r) with rsLoRA) so the apply is two matmuls."""

    name: str
    id: int
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _scale(cfg: dict, rank: int) -> float:
    alpha = float(cfg.get("lora_alpha", rank))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        raise ConfigError(f"LoRA adapter {str(folder)!r} has no adapter_model.safetensors")
    from safetensors.torch import load_file  # lazy: only loading an adapter needs it

    try:
        return load_file(str(path))
    except Exception as e:  # a truncated or corrupt file: safetensors raises its own error types
        raise ConfigError(f"LoRA adapter {str(folder)!r}: adapter_model.safetensors is unreadable ({e})") from None


def load_peft_adapter(name: str, lora_id: int, path: str, shapes: dict[tuple[int, str], tuple[int, int]],
                      max_rank: int) -> LoRAAdapter:
    """Read the adapter at ``path``; ``shapes``: the base model's (in, out) per (layer, module).

    Raises ConfigError for a missing file, a rank above ``max_rank``, a module the base has not, or
    a tensor whose shape is not the base's (an adapter trained for another model)."""
    folder = Path(path)
    where = f"{name!r} ({path})"
    cfg = check_adapter_files(path, max_rank)  # the options too (config/lora.py)
    rank = cfg["r"]
    scale = _scale(cfg, rank)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(folder).items():
        m = _KEY.search(key)
        if m is None or TARGETS.get(m.group(3)) != m.group(2):
            raise ConfigError(f"LoRA adapter {where}: tensor {key!r} targets no supported module "
                              f"({', '.join(TARGETS)})")
        pairs.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = tensor
    if not pairs:
        raise ConfigError(f"LoRA adapter {where} holds no LoRA tensors")
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        weights[(layer, module)] = _checked_pair(ab, (layer, module), shapes, rank, scale, where)
    return LoRAAdapter(name=name, id=lora_id, rank=rank, weights=weights)


def _checked_pair(ab: dict[str, torch.Tensor], key: tuple[int, str], shapes, rank: int, scale: float,
                  where: str) -> tuple[torch.Tensor, torch.Tensor]:
    layer, module = key
    if set(ab) != {"A", "B"}:
        raise ConfigError(f"LoRA adapter {where}: layer {layer} {module} lacks lora_{'B' if 'A' in ab else 'A'}")
    if key not in shapes:
        raise ConfigError(f"LoRA adapter {where}: the base model has no layer {layer} {module}")
    fan_in, fan_out = shapes[key]
    a, b = ab["A"], ab["B"]
    if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
        raise ConfigError(f"LoRA adapter {where}: layer {layer} {module} has A {tuple(a.shape)} and B "
                          f"{tuple(b.shape)}; the base model needs A ({rank}, {fan_in}) and B ({fan_out}, {rank}) "
                          "(an adapter for another base model?)")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ConfigError(f"LoRA adapter {where}: layer {layer} {module} holds NaN or infinite values")
    return a.float().contiguous(), (b.float() * scale).contiguous()
