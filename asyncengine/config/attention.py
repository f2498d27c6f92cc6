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
    row's result does not depend on the batch, the chunking or the cache (docs/batch_invariance.md).
    ``kv_int8``: it runs the 8-bit KV cache (``kv_cache_dtype="int8"``, docs/kv_cache_int8.md)."""

    name: str
    path: str
    devices: tuple[str, ...]
    cuda_graphs: bool = False
    batch_invariant: bool = False
    kv_int8: bool = False


BACKENDS: dict[str, BackendInfo] = {b.name: b for b in (
    # plain torch ops: the readable reference, any device
    BackendInfo(name="torch", path="asyncengine.attention.torch_backend:TorchBackend", devices=("cpu", "cuda"),
                kv_int8=True),
    # the C kernels (kernels/cpu): paged decode attention with no gather copy
    BackendInfo(name="cpu", path="asyncengine.attention.cpu_backend:CpuBackend", devices=("cpu",),
                batch_invariant=True, kv_int8=True),
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


def check_batch_invariant(device: str, attention_backend: str) -> None:
    """What cannot keep a row's bits independent of the batch is refused, not run silently."""
    if str(device).startswith("cuda"):
        raise ConfigError("batch_invariant=True runs on the CPU kernels only (device='cpu'); CUDA has no "
                          "batch-invariant matmul or attention here yet")
    if attention_backend != "auto" and not backend_info(attention_backend).batch_invariant:
        raise ConfigError(f"batch_invariant=True needs the 'cpu' attention backend; the "
                          f"{attention_backend!r} backend has no batch-invariant mode")


KV_CACHE_DTYPES = ("auto", "int8")


def check_kv_cache_dtype(kv_cache_dtype: str, attention_backend: str, device: str, batch_invariant: bool) -> None:
    """The 8-bit KV cache (issue 39) where it runs: CPU, the cpu and torch backends. (device "auto"
    on a GPU machine resolves to CUDA later: the backend refuses there, attention/int8_cache.py.)"""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be 'auto' (the model's dtype) or 'int8', got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return
    if attention_backend != "auto" and not backend_info(attention_backend).kv_int8:
        raise ConfigError(f"kv_cache_dtype='int8': the {attention_backend!r} attention backend reads only a 16/32-bit "
                          f"cache; use attention_backend='cpu' or 'torch'")
    if str(device).startswith("cuda"):
        raise ConfigError("kv_cache_dtype='int8' runs on CPU only (C kernels; no CUDA kernel reads it yet): "
                          "use device='cpu' or kv_cache_dtype='auto'")
    if batch_invariant:
        raise ConfigError("kv_cache_dtype='int8' is not batch invariant yet (batch_invariant=True runs the "
                          "16/32-bit cache's fixed-order kernels only)")


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
