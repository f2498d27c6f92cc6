"""Compute kernels: Triton kernels for CUDA, each with a torch reference beside it."""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any, Callable

__all__ = [
    "triton_available",
    "triton_interpret",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "paged_attention",
    "paged_attention_ref",
    "rms_norm",
    "rms_norm_ref",
]

_TRUE = {"1", "true", "yes", "on"}

# Public names -> submodule that defines them, imported on first access so that
# ``import asyncengine.kernels`` never needs triton (or even imports torch eagerly).
_LAZY = {
    "reshape_and_cache": "reshape_and_cache",
    "reshape_and_cache_ref": "reshape_and_cache",
    "paged_attention": "paged_attention",
    "paged_attention_ref": "paged_attention",
    "rms_norm": "rms_norm",
    "rms_norm_ref": "rms_norm",
}


def triton_interpret() -> bool:
    """True when ``TRITON_INTERPRET`` asks for triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising something else
        return False
    return True


def triton_available() -> bool:
    """True when triton imports AND it can run here: a CUDA device exists or TRITON_INTERPRET=1."""
    if not _triton_importable():
        return False
    if triton_interpret():
        return True
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# Kernels are kept as plain functions and handed to ``triton.jit`` on first launch, once per
# interpreter mode: triton decides "interpreted or compiled" when ``triton.jit`` runs, so
# decorating at import time would freeze whatever TRITON_INTERPRET was when the module was
# first imported (e.g. by a model module) and break a later interpreted test run on CPU.
_JIT_CACHE: dict[tuple[Callable[..., Any], bool], Any] = {}


def _jit(fn: Callable[..., Any]) -> Any:
    key = (fn, triton_interpret())
    kernel = _JIT_CACHE.get(key)
    if kernel is None:
        import triton

        kernel = _JIT_CACHE[key] = triton.jit(fn)
    return kernel


def _require_triton(what: str) -> None:
    if not _triton_importable():
        raise ImportError(
            f"{what} needs triton, which is not installed: `pip install triton` "
            "(it is in the `dev` extra; the torch reference `*_ref` functions work without it)."
        )


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
