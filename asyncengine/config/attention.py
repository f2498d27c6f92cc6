"""The attention backends, listed once: their names, where each lives and what it can do.

The config (its ``attention_backend`` field and check), the CLI's ``--attention-backend`` choices,
the selector and the model runner's CUDA-graph gate all read this table; adding a backend is one
row here plus its module. Torch-free, so checking a config never imports torch (tests/cli/test_cold_start.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import msgspec

from asyncengine.errors import ConfigError

if TYPE_CHECKING:
    import torch


class BackendInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One backend: ``name`` (the config value), ``path`` ("module:Class"), the ``devices`` it runs
    on, and ``cuda_graphs``: its per-step metadata lives at fixed addresses, so a decode step can be
    captured in a CUDA graph and replayed. ``batch_invariant``: it has a mode in which each query
    row's result does not depend on the batch, the chunking or the cache (docs/batch_invariance.md)."""

    name: str
    path: str
    devices: tuple[str, ...]
    cuda_graphs: bool = False
    batch_invariant: bool = False


BACKENDS: dict[str, BackendInfo] = {b.name: b for b in (
    # plain torch ops: the readable reference, any device
    BackendInfo(name="torch", path="asyncengine.attention.torch_backend:TorchBackend", devices=("cpu", "cuda")),
    # the C kernels (kernels/cpu): paged decode attention with no gather copy
    BackendInfo(name="cpu", path="asyncengine.attention.cpu_backend:CpuBackend", devices=("cpu",),
                batch_invariant=True),
    # the kernels/ Triton kernels; metadata in persistent buffers (CUDA graphs)
    BackendInfo(name="triton", path="asyncengine.attention.triton_backend:TritonBackend", devices=("cuda",),
                cuda_graphs=True),
)}

# what EngineConfig.attention_backend accepts: "auto" (resolve_backend_name) or a backend's name
BACKEND_CHOICES: tuple[str, ...] = ("auto", *BACKENDS)
AttentionBackendName = Literal[BACKEND_CHOICES]  # type: ignore[valid-type]  # built from the table


def check_backend_name(name: str) -> None:
    if name not in BACKEND_CHOICES:
        raise ConfigError(f"attention_backend must be one of {', '.join(BACKEND_CHOICES)}, got {name!r}")


def backend_info(name: str) -> BackendInfo:
    """The row of a resolved backend name (not "auto")."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown attention backend {name!r}") from None


def resolve_backend_name(name: str, device: torch.device) -> str:
    """auto: triton on CUDA (where triton imports); on CPU, cpu where its C kernels build (compiled
    once per machine, cached), torch otherwise."""
    check_backend_name(name)
    if name != "auto":
        return name
    if device.type == "cuda":
        from asyncengine.kernels import triton_available  # lazy: the kernels build/load (C compile, triton) only on this path

        return "triton" if triton_available() else "torch"
    from asyncengine.kernels.cpu import available  # lazy: the kernels build/load (C compile, triton) only on this path

    return "cpu" if available() else "torch"
