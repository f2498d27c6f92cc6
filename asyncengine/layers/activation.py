"""Gated activations of the MLP: ``act(gate) * up`` over the fused gate/up projection's output.

SiLU (Llama, Mistral, Qwen) is one fused C call on CPU (``kernels/cpu/ops.c``: no [T, inter]
intermediate, one pass); the others, and every device without the kernels, run the torch ops."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncengine.kernels.cpu import ops

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class ActAndMul:
    """Callable: x = [gate | up] along the last dim -> act(gate) * up."""

    def __init__(self, name: str) -> None:
        if name not in ACTIVATIONS:
            raise ValueError(f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.name = name
        self.act = ACTIVATIONS[name]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.name == "silu" and x.device.type == "cpu":
            return ops.silu_and_mul(x)  # falls back to the torch ops where the kernel does not apply
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
