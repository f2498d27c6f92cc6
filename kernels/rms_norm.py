"""Fused RMSNorm (optionally with the residual add before it), Llama/HF numerics.

``rms_norm(x, weight, eps)``                -> ``weight * (x / rms(x))``
``rms_norm(x, weight, eps, residual=r)``    -> ``(weight * norm(x + r), x + r)``

Numerics follow HF ``LlamaRMSNorm`` (and the usual ``residual + hidden`` before it): the residual sum is
rounded to the input dtype, the statistics are fp32, the normalised value is rounded to the input dtype
and then multiplied by ``weight``.
"""

from __future__ import annotations

import torch

from . import _jit, _next_pow2, _require_triton

tl = None  # triton.language, bound by kernels._jit at first launch (importing this module never needs triton)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rms_norm`."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight.float() * normed.float()).to(x.dtype)
    return out if residual is None else (out, x)


def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_cols, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.reduce(xf * xf, 0, tl.standard._sum_combine) / n_cols
    normed = (xf * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton fused RMSNorm over the last dim; with ``residual`` returns ``(normed, x + residual)``.

    ``x``/``residual`` may have any leading shape; their last dim must be contiguous. New tensors are
    returned (inputs are not modified).
    """
    _require_triton("rms_norm")
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"weight must be [{h}], got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, h)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    weight = weight.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, h, dtype=x.dtype, device=x.device)
    res_out = torch.empty(rows, h, dtype=x.dtype, device=x.device) if r2 is not None else out
    if rows:
        block = _next_pow2(h)
        num_warps = min(16, max(1, block // 256))
        _jit(_rms_norm_kernel)[(rows,)](
            x2, r2 if r2 is not None else x2, weight, out, res_out,
            h, float(eps),
            x2.stride(0), (r2 if r2 is not None else x2).stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=r2 is not None, BLOCK=block, num_warps=num_warps, enable_fp_fusion=True,
        )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))
