"""Which attention backend an engine uses: ``EngineConfig.attention_backend``."""
from __future__ import annotations

import torch

from asyncengine.attention.backend import AttentionBackend
from asyncengine.config import ATTENTION_BACKENDS as BACKENDS
from asyncengine.errors import ConfigError


def resolve_backend_name(name: str, device: torch.device) -> str:
    """auto: triton on CUDA (where triton imports); on CPU, cpu where its C kernels build (compiled
    once per machine, cached), torch otherwise."""
    if name not in BACKENDS:
        raise ConfigError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name != "auto":
        return name
    if device.type == "cuda":
        from asyncengine.kernels import triton_available

        return "triton" if triton_available() else "torch"
    from asyncengine.kernels.cpu import available

    return "cpu" if available() else "torch"


def get_backend(name: str, **kwargs) -> AttentionBackend:
    """Build the backend ``name`` (already resolved, not "auto") with the runner's shapes."""
    if name == "torch":
        from asyncengine.attention.torch_backend import TorchBackend

        return TorchBackend(**kwargs)
    if name == "cpu":
        from asyncengine.attention.cpu_backend import CpuBackend

        return CpuBackend(**kwargs)
    if name == "triton":
        from asyncengine.attention.triton_backend import TritonBackend

        return TritonBackend(**kwargs)
    raise ConfigError(f"unknown attention backend {name!r}")
