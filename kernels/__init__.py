"""Compute kernels: Triton kernels for CUDA, each with a torch reference beside it."""

from __future__ import annotations

import functools
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


# Kernels are written as plain module-level functions and handed to ``triton.jit`` on first launch,
# once per interpreter mode:
# * triton decides "interpreted or compiled" when ``triton.jit`` runs, so decorating at import time
#   would freeze whatever TRITON_INTERPRET was when the module was first imported (e.g. by a model
#   module) and break a later interpreted test run on CPU;
# * importing this package never imports triton (~0.5 s, and optional): the kernel modules start with
#   ``tl = None`` and string annotations (``from __future__ import annotations``; triton reads
#   "tl.constexpr" fine), and ``_jit`` binds the module's ``tl`` to ``triton.language`` just before the
#   first decoration.
_JIT_CACHE: dict[tuple[Callable[..., Any], bool], Any] = {}


def _jit(fn: Callable[..., Any]) -> Any:
    key = (fn, triton_interpret())
    kernel = _JIT_CACHE.get(key)
    if kernel is None:
        _require_triton(fn.__name__.strip("_"))
        import triton
        import triton.language

        fn.__globals__["tl"] = triton.language
        if triton_interpret():
            _fix_interpreter_scalars()
        kernel = _JIT_CACHE[key] = triton.jit(fn)
    return kernel


def _fix_interpreter_scalars() -> None:
    """Triton's CPU interpreter before 3.7 holds every scalar as a 1-element array and converts it
    to a Python int with ``int(array)``, which NumPy >= 2.3 refuses ("only 0-dimensional arrays can
    be converted to Python scalars"): every data-dependent loop bound in our kernels then fails
    (it did on a GPU machine with triton 3.6). Triton 3.7 squeezes first; do the same on older ones."""
    try:
        from triton.runtime import interpreter
    except Exception:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_asyncengine_fixed", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0])
                       if self.handle.data.size == 1 else int(self.handle.data))

    patched._asyncengine_fixed = True
    interpreter._patch_lang_tensor = patched


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _require_triton(what: str) -> None:
    if not _triton_importable():
        raise ImportError(
            f"{what} needs triton, which is not installed: `pip install triton` "
            "(it is in the `dev` extra; the torch reference `*_ref` functions work without it)."
        )


# Eager, cheap (torch only): binding the functions here also keeps ``asyncengine.kernels.paged_attention``
# etc. the *functions* whatever the import order (use importlib / sys.modules for the modules).
from .paged_attention import paged_attention, paged_attention_ref  # noqa: E402
from .reshape_and_cache import reshape_and_cache, reshape_and_cache_ref  # noqa: E402
from .rms_norm import rms_norm, rms_norm_ref  # noqa: E402
