"""The batch-invariant dense matmul of ``invariant.c``: ``x @ W^T (+ b)`` whose every output row has
the same bits whatever the number of rows, the other rows, or the thread count (the C file says
how). Engines in batch-invariant mode (``EngineConfig.batch_invariant``) run every dense
projection and the LM head through :func:`linear`.

Where the library is not built (no C compiler, ``ASYNCENGINE_CPU_KERNELS=0``) or the dtype is not
float32/bfloat16, :func:`linear` multiplies one row at a time with ``F.linear``: the BLAS then sees
M = 1 for every row, so the result cannot depend on the batch either (slow, and its bits may
depend on the thread count).
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from asyncengine.kernels.cpu.build import LazyBinding

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_SIGNATURES = {"ae_inv_linear": [_P, _L, _P, _P, _P, _L, _L, _L, _I, _I]}

_lib = LazyBinding(_SIGNATURES)  # the bound functions, or False where the library is not built
available = _lib.available
_reset_for_tests = _lib.reset


def kernel_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (bool(_lib()) and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.is_contiguous()
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with a fixed reduction order per output row."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {k}")
    lead = x.shape[:-1]
    if not kernel_applies(x, weight, bias):
        return linear_rowwise(x, weight, bias)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    if m:
        _lib()["ae_inv_linear"](x2.data_ptr(), x2.stride(0) if m > 1 else k, weight.data_ptr(),
                                None if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k,
                                int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out.view(*lead, n)


def linear_rowwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fallback: one ``F.linear`` per row (M = 1 every time, so no M-dependent blocking)."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = [F.linear(x2[i:i + 1], weight, bias) for i in range(x2.shape[0])]
    out = torch.cat(rows) if rows else F.linear(x2, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])
