"""Rotary position embeddings (the non-interleaved "rotate half" form) with the rope scaling types
Llama-family checkpoints use: default, linear, dynamic-free llama3, and Phi-3's LongRoPE ("su"):
short factors below the original context, long ones from it on (per position, as vLLM does: a
request's earlier keys keep the rotation they were cached with). Partial rotary (Phi-4-mini)
rotates the first ``partial_rotary_factor`` of each head only. cos/sin are tabulated once for
every position up to max_model_len and gathered per token, so the hot path is two multiplies."""
from __future__ import annotations

import math

import torch
from torch import nn

from asyncengine.errors import ModelLoadError
from asyncengine.kernels.cpu import ops


def rope_parameters(config) -> dict:
    """The rope settings of an HF config, across transformers versions (v5: ``rope_parameters``)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default") or "default")
    if params["rope_type"] == "su":
        params["rope_type"] = "longrope"
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None:
        params["partial_rotary_factor"] = float(partial)
    if params["rope_type"] == "longrope":
        orig = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None) or config.max_position_embeddings
        params["original_max_position_embeddings"] = orig
        params.setdefault("factor", config.max_position_embeddings / orig)
    return params


def rotary_dim(head_dim: int, params: dict) -> int:
    """How many of a head's dims rotate (Phi-4-mini: 3/4 of them)."""
    return int(head_dim * float(params.get("partial_rotary_factor") or 1.0))


def _longrope(dim: int, params: dict, factors: str) -> torch.Tensor:
    theta = float(params["rope_theta"])
    ext = torch.tensor(params[factors], dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def attention_factor(params: dict) -> float:
    """LongRoPE's cos/sin multiplier: given, or sqrt(1 + ln(factor) / ln(original length))."""
    if params["rope_type"] != "longrope":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(params["original_max_position_embeddings"]))


def compute_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    theta = float(params["rope_theta"])
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "longrope":
        return _longrope(head_dim, params, "short_factor")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low_ff = float(params["low_freq_factor"])
        high_ff = float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        low_wavelen = old_ctx / low_ff
        high_wavelen = old_ctx / high_ff
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are scaled down by `factor`, short ones kept, the band between blended
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)
    raise ModelLoadError(f"rope type {rope_type!r} is not supported (default, linear, llama3, longrope)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, params: dict) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.params = head_dim, max_positions, params
        self.rotary_dim = rotary_dim(head_dim, params)
        self.build()

    def build(self, device: torch.device | None = None) -> None:
        """(Re)compute the tables; called again after the model is materialised from meta."""
        with torch.device("cpu"):  # real numbers even under a meta-device context (meta ops import dynamo)
            inv_freq = compute_inv_freq(self.rotary_dim, self.params)
            pos = torch.arange(self.max_positions, dtype=torch.float32)
            freqs = torch.outer(pos, inv_freq)
            if self.params["rope_type"] == "longrope":  # positions from the original length: long factors
                orig = int(self.params["original_max_position_embeddings"])
                freqs[orig:] = torch.outer(pos[orig:], _longrope(self.rotary_dim, self.params, "long_factor"))
            emb = torch.cat([freqs, freqs], dim=-1)
            scale = attention_factor(self.params)
            self.cos = emb.cos() * scale  # [max_pos, rotary_dim], fp32 (plain attributes: never cast)
            self.sin = emb.sin() * scale
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._cast:
            # sin with the first half negated: rotate_half(x) * sin == swap_halves(x) * sin_signed
            # exactly (a sign flip rounds the same either way)
            sin = self.sin.to(dtype)
            half = self.rotary_dim // 2
            signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
            self._cast[dtype] = (self.cos.to(dtype), signed)
        return self._cast[dtype]

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) rows of these positions, [T, 1, D]: once per step, shared by every layer."""
        cos_t, sin_t = self.tables(dtype)
        return cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D]; returns rotated copies."""
        cos, sin = self.lookup(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1): the same numbers as the
    reference's two multiplies and add, in one op fewer (the sign lives in ``sin_signed``). On CPU,
    one C call (kernels/cpu/ops.c) computing the same roundings: q and k heads of the fused
    projection in one pass, read in place. Cos/sin narrower than the head (partial rotary): the first dims
    rotate, the rest pass through."""
    rd = cos.shape[-1]
    if rd != x.shape[-1]:
        out = x.clone()
        out[..., :rd] = apply_rotary(x[..., :rd].contiguous(), cos, sin_signed)
        return out
    if x.device.type == "cpu":
        return ops.rotary(x, cos, sin_signed)  # the torch ops below where the kernel does not apply
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed
