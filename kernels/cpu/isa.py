"""The instruction set of the dense CPU kernels (paged attention, the fused elementwise ops),
chosen at run time from what the CPU reports and the OS grants (cpuid + XCR0, ``isa.c``): the best
by default. ``ASYNCENGINE_CPU_ISA`` forces a lower path for every kernel (read when the library
loads; the int8 GEMM of ``quant.py`` takes the same variable, ``avx512_bf16`` meaning its best path
there); :func:`set_isa` switches at run time (the tests run each path this CPU can execute).
"""
from __future__ import annotations

import ctypes
import os

# isa.c's levels, in order: each runs every path below it
ISAS = ("scalar", "avx2", "avx512_vnni", "avx512_bf16")


class IsaError(ValueError):
    """An ISA this CPU cannot execute, or an unknown name."""


def _bind(lib) -> None:
    if not hasattr(lib, "_ae_isa_ready"):
        for name, args in (("ae_isa_cpu", []), ("ae_isa_get", []), ("ae_isa_set", [ctypes.c_int])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        lib._ae_isa_ready = True


def _set(lib, name: str, what: str) -> str:
    _bind(lib)
    if name != "auto" and name not in ISAS:
        raise IsaError(f"{what}={name!r}: expected auto or one of {', '.join(ISAS)}")
    if lib.ae_isa_set(-1 if name == "auto" else ISAS.index(name)) < 0:
        raise IsaError(f"{what}={name}: this CPU (or its OS) cannot execute it; the best it can is "
                       f"{ISAS[lib.ae_isa_cpu()]}")
    return ISAS[lib.ae_isa_get()]


def apply_env(lib) -> None:
    """Force the level ``ASYNCENGINE_CPU_ISA`` names (build.load calls this once)."""
    want = os.environ.get("ASYNCENGINE_CPU_ISA", "auto").strip().lower() or "auto"
    if want != "auto":
        _set(lib, want, "ASYNCENGINE_CPU_ISA")


def _lib():
    from asyncengine.kernels.cpu.build import load

    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not built: there is no ISA to choose")
    _bind(lib)
    return lib


def cpu_isa() -> str:
    """The best level this CPU can execute."""
    return ISAS[_lib().ae_isa_cpu()]


def isa() -> str:
    """The level in use."""
    return ISAS[_lib().ae_isa_get()]


def set_isa(name: str) -> str:
    """Use level ``name`` (``"auto"``: the best); returns the level now in use."""
    return _set(_lib(), name, "isa")
