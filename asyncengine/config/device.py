"""The device and dtype a model runs in: their spellings checked without torch (when EngineConfig is
built, in any process), resolved with torch on first use in the process that runs the model
(``ModelConfig.torch_device`` / ``torch_dtype``, config/sub_configs.py). A module of its own so that
the model's view resolves them without the whole EngineConfig."""
from __future__ import annotations

import re
from functools import lru_cache
from typing import TYPE_CHECKING

from asyncengine.errors import ConfigError

if TYPE_CHECKING:
    import torch

# torch is imported only where a device or dtype is resolved: a front end whose core runs in
# another process never pays for it
_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                "float16": "float16", "fp16": "float16", "half": "float16"}
_DEVICE_RE = re.compile(r"^(cpu|cuda)(:\d+)?$")
QUANTIZATION_MODES = (None, "none", "int8", "int4")


@lru_cache(maxsize=1)
def cpu_auto_dtype() -> torch.dtype:
    """The CPU's fastest GEMM type, by a measured probe cached per machine (platforms/dtype_probe.py):
    a bf16 CPU flag has meant 4x fp32 on one machine of ours and half of it on another."""
    from asyncengine.platforms.dtype_probe import fastest_cpu_dtype  # lazy: torch, only where a device or dtype is resolved

    return fastest_cpu_dtype()


def check_device(device: str) -> None:
    """The device's spelling, without torch: auto, cpu, cuda or cuda:N."""
    if device != "auto" and not _DEVICE_RE.match(str(device)):
        raise ConfigError(f"device {device!r} is not supported (cpu, cuda, cuda:N, auto)")


def resolve_device(device: str) -> torch.device:
    import torch
    check_device(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but torch sees no CUDA GPU")
    return dev


def check_dtype(dtype) -> None:
    """The dtype's spelling (a torch dtype only if the caller has torch already)."""
    if isinstance(dtype, str):
        if dtype != "auto" and dtype not in _DTYPE_NAMES:
            raise ConfigError(f"dtype {dtype!r} is not one of auto, float32, bfloat16, float16")
        return
    import torch

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"dtype {dtype} is not supported (float32, bfloat16, float16)")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    import torch

    check_dtype(dtype)
    if not isinstance(dtype, str):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return cpu_auto_dtype()
    return getattr(torch, _DTYPE_NAMES[dtype])


def check_quantization_device(quantization: str | None, device_type: str) -> None:
    if quantization in ("int8", "int4") and device_type != "cpu":
        raise ConfigError(f"quantization={quantization!r} runs on the CPU kernels only; on "
                          f"{device_type} load dense weights (quantization=None or 'none')")


def block_quantized(model: str | None, quantization: str | None) -> bool:
    """Whether the weights run on the block-quantized CPU kernels: a GGUF (the default model is
    one) kept in its blocks, or a dense checkpoint quantized at load."""
    if quantization in ("int8", "int4"):
        return True
    name = str(model or "smollm2-135m-instruct").strip().lower()
    return quantization is None and (name.endswith(".gguf") or name == "smollm2-135m-instruct")


def dtype_reason(dtype, device: torch.device, block_quantized_weights: bool) -> str:
    """Why the resolved dtype is what it is, for the ready line and ``status``."""
    if dtype != "auto":
        return "asked for"
    if device.type == "cuda":
        return "auto: bfloat16 on a GPU"
    if block_quantized_weights:
        # measured (docs/cpu_decode.md): the quantized kernels compute in fp32 whatever x's dtype;
        # bf16 activations only add conversions, and coarser logits flip greedy answers
        return "auto: block-quantized weights run fp32/int8 kernels"
    return "auto: the CPU's fastest GEMM type (measured once per machine)"
