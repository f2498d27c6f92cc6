"""The fused small ops of ``ops.c`` (RMSNorm, residual add + RMSNorm, rotary, SiLU-and-mul), with
the torch code they replace as the fallback.

Each function takes what the layer has, checks that the C path applies (CPU, float32 or bfloat16,
the layout the kernel reads) and otherwise runs the torch ops. Both paths compute the same steps in
the same precision (fp32 math, results rounded to the dtype where torch rounds them); only the
order of a reduction's additions (the norm's sum of squares) and exp's last bit may differ.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from asyncengine.kernels.cpu.build import LazyBinding

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "ae_ops_rms_norm": [_P, _L, _L, _I, _I, _P, _P, _I, _F, _I, _I],
    "ae_ops_add_rms_norm": [_P, _P, _P, _P, _P, _I, _I, _F, _I, _I],
    "ae_ops_rotary": [_P, _L, _P, _L, _I, _I, _I, _P, _P, _I, _I],
    "ae_ops_silu_mul": [_P, _L, _P, _I, _I, _I, _I],
}
# elements a call must touch before it is split over the OpenMP threads: below this the threads'
# wake-up costs more than the work (a decode step's norm of 576 values is ~0.3 us serial)
PARALLEL_MIN_ELEMENTS = 1 << 16

_lib = LazyBinding(_SIGNATURES)  # the bound functions, or False where the library is not built
_reset_for_tests = _lib.reset


def _kind(x: torch.Tensor) -> int:
    """0 float32, 1 bfloat16, -1 not for the kernels."""
    if x.device.type != "cpu":
        return -1
    if x.dtype == torch.float32:
        return 0
    if x.dtype == torch.bfloat16:
        return 1
    return -1


# ---------------------------------------------------------------------------- RMSNorm


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference: fp32 statistics, the normalised value rounded to x's dtype, times weight."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. The kernel reads x as [outer, inner, dim] (a [T, H, D] view of a
    fused projection, as Qwen3's per-head q/k norms have, or a plain [T, dim])."""
    fns = _lib()
    bf16 = _kind(x)
    if (not fns or bf16 < 0 or weight.dtype != x.dtype or x.dim() not in (2, 3) or x.stride(-1) != 1
            or not weight.is_contiguous() or x.shape[-1] != weight.shape[0] or x.numel() == 0):
        return rms_norm_torch(x, weight, eps)
    if x.dim() == 2:
        outer, inner, so, si = x.shape[0], 1, x.stride(0), 0
    else:
        outer, inner, so, si = x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype)
    fns["ae_ops_rms_norm"](x.data_ptr(), so, si, outer, inner, out.data_ptr(), weight.data_ptr(), dim, eps, bf16,
                           x.numel() >= PARALLEL_MIN_ELEMENTS)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in one pass."""
    fns = _lib()
    bf16 = _kind(x)
    if (not fns or bf16 < 0 or residual.dtype != x.dtype or weight.dtype != x.dtype or not x.is_contiguous()
            or not residual.is_contiguous() or x.shape != residual.shape or not weight.is_contiguous()
            or x.shape[-1] != weight.shape[0] or x.numel() == 0):
        s = x + residual
        return rms_norm_torch(s, weight, eps), s
    dim = x.shape[-1]
    rows = x.numel() // dim
    s = torch.empty_like(x)
    out = torch.empty_like(x)
    fns["ae_ops_add_rms_norm"](x.data_ptr(), residual.data_ptr(), s.data_ptr(), out.data_ptr(), weight.data_ptr(),
                               rows, dim, eps, bf16, x.numel() >= PARALLEL_MIN_ELEMENTS)
    return out, s


# ---------------------------------------------------------------------------- rotary


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, the sign of rotate_half living in ``sin_signed``."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (heads contiguous, tokens any stride); cos, sin_signed: [T, 1, D] or [T, D], x's
    dtype. Returns a rotated copy, contiguous."""
    fns = _lib()
    bf16 = _kind(x)
    if (not fns or bf16 < 0 or x.dim() != 3 or cos.dtype != x.dtype or sin_signed.dtype != x.dtype
            or x.stride(2) != 1 or x.stride(1) != x.shape[2] or not cos.is_contiguous()
            or not sin_signed.is_contiguous() or cos.numel() != x.shape[0] * x.shape[2]
            or sin_signed.numel() != cos.numel() or x.shape[2] % 2 or x.shape[2] > 1024 or x.numel() == 0):
        return rotary_torch(x, cos, sin_signed)
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype)
    fns["ae_ops_rotary"](x.data_ptr(), x.stride(0), out.data_ptr(), h * d, t, h, d, cos.data_ptr(),
                         sin_signed.data_ptr(), bf16, x.numel() >= PARALLEL_MIN_ELEMENTS)
    return out


# ---------------------------------------------------------------------------- activation


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up where x = [gate | up] along the last dim (the fused gate/up projection)."""
    fns = _lib()
    bf16 = _kind(x)
    if not fns or bf16 < 0 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] % 2 or x.numel() == 0:
        return silu_and_mul_torch(x)
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype)
    fns["ae_ops_silu_mul"](x.data_ptr(), x.stride(0), out.data_ptr(), rows, inter, bf16,
                           x.numel() >= PARALLEL_MIN_ELEMENTS)
    return out
