"""The x8 layout of block-quantized weights (kernels/cpu/quant_common.h): rows repacked 8 at a time,
block by block, so the int8 kernel (kernels/cpu/quant_x8.h) makes 8 rows' dot products per vector
op. Repacked once, in place, when a layer's activation mode becomes int8 (``Linear.set_activations``);
back to the file's rows for fp32, whose kernel reads a row at a time. Every kernel gives the same
bits on either layout (tests/kernels/test_quant_x8.py).

``ASYNCENGINE_QUANT_LAYOUT=rows`` keeps the file's layout (the before/after switch of the benchmarks).
"""
from __future__ import annotations

import os

import torch

from asyncengine.kernels.cpu.quant import K_QUANTS, QTYPES, _lib, check, cpu_isa

GROUP = 8  # rows per group (quant.x8_torch: the layout in torch)


def layout_from_env() -> str:
    """``ASYNCENGINE_QUANT_LAYOUT`` = x8 (default: repack at load where the rows allow) | rows."""
    mode = os.environ.get("ASYNCENGINE_QUANT_LAYOUT", "x8").strip().lower() or "x8"
    if mode not in ("x8", "rows"):
        raise ValueError(f"ASYNCENGINE_QUANT_LAYOUT={mode!r}: expected x8 or rows")
    return mode


def can_pack(n: int, qtype: str | None = None) -> bool:
    """Whether a weight of ``n`` rows is repacked for int8: whole groups of 8, the layout switch on,
    a SIMD copy of the x8 kernel on this CPU (the portable C one is slower on x8 than on rows), and
    a format of 32-value blocks (the K-quants keep the file's rows: quant_k_isa.h)."""
    return (n > 0 and n % GROUP == 0 and qtype not in K_QUANTS and layout_from_env() == "x8"
            and cpu_isa() not in (None, "scalar"))


def pack(w: torch.Tensor, qtype: str, k: int) -> None:
    """The file's rows -> x8, in place (no copy of the weight is made; one group of scratch)."""
    _convert(w, qtype, k, "ae_q_repack_x8")


def unpack(w: torch.Tensor, qtype: str, k: int) -> None:
    """x8 -> the file's rows, in place."""
    _convert(w, qtype, k, "ae_q_unpack_x8")


def _convert(w: torch.Tensor, qtype: str, k: int, fn: str) -> None:
    n = check(w, qtype, k)
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CPU kernels are not built: weights stay in the file's layout")
    rc = getattr(lib, fn)(QTYPES[qtype][0], w.data_ptr(), n, k)
    if rc:
        raise MemoryError(f"{fn} failed ({rc}): N={n} must be a multiple of {GROUP}, or out of memory")
