"""CPU kernels in plain C (AVX2/FMA where the CPU has it), compiled once per machine and cached.

Why C through ctypes and not a torch extension: the sources include no torch header, so the first
build takes seconds, not a minute, and needs no ninja; a call costs ~1-2 us. Each kernel works on
raw pointers of contiguous tensors the Python side checks. OpenMP inside the kernels links the
same ``libgomp.so.1`` torch already loaded, so torch ops and ours share one thread pool.

Use :func:`load` to get the library (None where no C compiler is found or the build fails: callers
then keep their torch path) and :func:`available` to ask.
"""
from asyncengine.kernels.cpu.build import available, build_error, load

__all__ = ["available", "build_error", "load"]
