"""The instruction set of the dense CPU kernels (paged attention, the fused elementwise ops),
chosen at run time from what the CPU reports and the OS grants (cpuid + XCR0, ``isa.c``): the best
by default. ``ASYNCENGINE_CPU_ISA`` forces a lower path for every kernel (read when the library
loads, ``build.py``; the int8 GEMM of ``quant.py`` takes the same variable, ``avx512_bf16`` meaning
its best path there); :func:`set_isa` switches at run time (the tests run each path this CPU can
execute).
"""
from __future__ import annotations

from asyncengine.kernels.cpu.build import ISAS, IsaError, bind_isa, load, set_isa_level

__all__ = ["ISAS", "IsaError", "cpu_isa", "isa", "set_isa"]


def _lib():
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not built: there is no ISA to choose")
    bind_isa(lib)
    return lib


def cpu_isa() -> str:
    """The best level this CPU can execute."""
    return ISAS[_lib().ae_isa_cpu()]


def isa() -> str:
    """The level in use."""
    return ISAS[_lib().ae_isa_get()]


def set_isa(name: str) -> str:
    """Use level ``name`` (``"auto"``: the best); returns the level now in use."""
    return set_isa_level(_lib(), name, "isa")
