"""The K-quant formats' activations (Q4_K, Q5_K, Q6_K; the kernels: quant_k.h, quant_k_isa.h): the
q8_K blocks their int8 kernel multiplies with, from C, and the torch reference the tests hold it
to. Shapes, type ids, dequantization and the GEMM itself are quant.py's, shared with the 32-value
formats."""
from __future__ import annotations

import torch

from asyncengine.kernels.cpu.quant import QK, _inverse, _lib


def quantize_activations_k_torch(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [M, K] -> (q int8 [M, K], d fp32 [M, K/256]): the q8_K blocks the K-quant kernel
    multiplies with, as quant_k.h makes them (d = max|x| / 127, q = rint(x * (1 / d)))."""
    m, k = x2.shape
    blocks = x2.to(torch.float32).reshape(m, k // QK, QK)
    d = blocks.abs().amax(-1) / 127
    q = torch.round(blocks * _inverse(d).unsqueeze(-1)).to(torch.int8)
    return q.reshape(m, k), d


def quantize_activations_k(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C kernel's own q8_K blocks of fp32 [M, K] (K a multiple of 256)."""
    lib = _lib()
    x2 = x2.to(torch.float32).contiguous()
    m, k = x2.shape
    if lib is None:
        return quantize_activations_k_torch(x2)
    q, d = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // QK)
    if lib.ae_q_quantize_act_k(x2.data_ptr(), m, k, q.data_ptr(), d.data_ptr()):
        raise ValueError(f"K={k} is not a multiple of {QK}")
    return q, d
