"""RMSNorm, computed in float32 like the reference implementation (token-exact parity needs it).

On CUDA (where triton imports) it is one fused Triton launch (asyncengine.kernels.rms_norm), the
residual add included when given: same numbers (the sum rounded to the dtype once, the norm in
fp32), one pass over memory instead of half a dozen elementwise kernels. On CPU it is one C call
(kernels/cpu/ops.c, the same steps), with the torch ops as the fallback."""
from __future__ import annotations

import torch
from torch import nn

from asyncengine.kernels.cpu import ops


def _triton_on(x: torch.Tensor) -> bool:
    if not x.is_cuda:
        return False
    from asyncengine.kernels import _triton_importable  # lazy: the kernels build/load (C compile, triton) only on this path

    return _triton_importable()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with ``residual``: (norm(x + residual), x + residual)."""
        if _triton_on(x) and x.dtype == self.weight.dtype:
            from asyncengine.kernels import rms_norm  # lazy: the kernels build/load (C compile, triton) only on this path

            return rms_norm(x, self.weight, self.eps, residual=residual)
        if x.device.type == "cpu":  # one C call (kernels/cpu/ops.c), or these torch ops where it does not apply
            if residual is not None:
                return ops.add_rms_norm(x, residual, self.weight, self.eps)
            return ops.rms_norm(x, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
