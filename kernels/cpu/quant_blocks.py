"""The per-block math of quant.quantize (dense -> Q4_0 / Q4_1 / Q8_0 blocks), byte-identical to
gguf-py's quantizer (ggml's reference rounding); torch only, so quant.py imports it without a cycle."""
from __future__ import annotations

import torch


def roundf_ggml(v: torch.Tensor) -> torch.Tensor:
    """ggml's roundf (half away from zero), in gguf-py's formulation, so bytes match its quantizer."""
    a = v.abs()
    f = a.floor()
    return torch.sign(v) * (f + (2 * (a - f)).floor())


def inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    q = q.to(torch.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _half_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def quantize_blocks(x: torch.Tensor, qtype: str) -> torch.Tensor:
    if qtype == "Q8_0":
        d = x.abs().amax(dim=1, keepdim=True) / 127
        q = roundf_ggml(x * inverse(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_half_bytes(d), q], dim=1)
    if qtype == "Q4_1":
        mx, mn = x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True)
        d = (mx - mn) / 15
        q = torch.trunc((x - mn) * inverse(d) + 0.5).clamp(0, 15)
        return torch.cat([_half_bytes(d), _half_bytes(mn), _pack_nibbles(q)], dim=1)
    if qtype == "Q4_0":
        imax = x.abs().argmax(dim=1, keepdim=True)
        d = torch.gather(x, 1, imax) / -8
        q = torch.trunc(x * inverse(d) + 8.5).clamp(0, 15)
        return torch.cat([_half_bytes(d), _pack_nibbles(q)], dim=1)
    raise ValueError(f"unknown block format {qtype!r} (supported: {', '.join(('Q4_0', 'Q4_1', 'Q8_0'))})")
