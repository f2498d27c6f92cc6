"""GGUF block-quantized weights (Q4_0, Q4_1, Q8_0; K-quants: quant_k.py) on CPU: quant.c through ctypes, torch beside it.

A weight is kept as the file's raw blocks, ``uint8 [N, K // 32 * block_bytes]`` (row n = its K
values in blocks of 32). :func:`gemm` computes ``x @ dequant(W)^T`` with the C kernel (fp32 math,
exact up to summation order: see quant.c); without the library (no compiler,
``ASYNCENGINE_CPU_KERNELS=0``) every function here falls back to torch, which dequantizes per call:
correct, slower. The torch functions are also the references the tests hold the kernels to.

:func:`quantize` turns dense weights into blocks with gguf-py's (= ggml's reference) rounding, for
``quantization="int8" | "int4"`` of a dense checkpoint.

Activations (``ASYNCENGINE_QUANT_ACTIVATIONS``, per engine ``EngineConfig.quantized_activations``):
``int8`` (the default) quantizes each row of x once to 8-bit blocks of 32 (scale d = max|x| / 127,
and s = d * sum(q) for the Q4 min terms: ggml's Q8_1) and multiplies with integer dot products,
AVX512-VNNI / AVX2 / portable C chosen at run time (:func:`isa`), at every M, on weights repacked
at load into the x8 layout (kernels/cpu/repack.py): llama.cpp's method, and as accurate on real text
(perplexity of the default model 15.31 vs llama.cpp's 15.34 on the same GGUF and text; fp32: 15.25).
Why it is the default: a decode token of the default model costs 2.2x less CPU than with fp32
activations (docs/cpu_decode.md). ``fp32`` keeps x in fp32 (exact up to summation order), with the
tiled dequantize + torch.mm path from ``LARGE_M`` rows; it agrees with an fp32 reference where int8
may flip a near-tie (the default model's answer to the README's question: a 0.08-nat tie in fp32,
flipped by int8 exactly as llama.cpp's does).
"""
from __future__ import annotations

import ctypes
import os

import torch

from asyncengine.kernels.cpu.build import load
from asyncengine.kernels.cpu.quant_blocks import inverse as _inverse
from asyncengine.kernels.cpu.quant_blocks import quantize_blocks as _quantize_blocks

BLOCK = 32
# name -> (GGML type id, bytes per block: of 32 values, of 256 for the K-quants)
QTYPES: dict[str, tuple[int, int]] = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34),
                                      "Q4_K": (12, 144), "Q5_K": (13, 176), "Q6_K": (14, 210)}
# K-quant super-blocks of QK values (quant_k.h, quant_k.py): the file's rows, no quantizer here.
K_QUANTS, QK = ("Q4_K", "Q5_K", "Q6_K"), 256


def block_len(qtype: str) -> int:
    """Values per block of ``qtype``: 32, or 256 for the K-quants."""
    return QK if qtype in K_QUANTS else BLOCK

# The x8 layout (kernels/cpu/quant_common.h, repacking: kernels/cpu/repack.py): rows repacked 8 at a
# time at load, in place, for the int8 kernel. The functions below take ``packed=True`` for a weight
# in it; the C side gets the type id with this flag. Same results, bit for bit.
X8 = 0x100


def type_id(qtype: str, packed: bool = False) -> int:
    return QTYPES[qtype][0] | (X8 if packed else 0)


def _rows(w: torch.Tensor, qtype: str, k: int, packed: bool) -> torch.Tensor:
    """The file's row layout of ``w`` (a copy where packed): for the torch fallbacks."""
    return x8_torch(w, qtype, k, inverse=True) if packed else w


# fp32 activations: at or above this many rows of x, gemm dequantizes W a tile of rows at a time into fp32 scratch
# and calls torch.mm (the BLAS's register blocking beats ours once W is reused by enough rows).
# Measured on a 2-core AVX2 EPYC (docs/quantization.md): the kernel wins below ~48 rows.
LARGE_M = 48
_TILE_BYTES = 4 << 20  # fp32 scratch of one tile in the large-M path

ACTIVATION_MODES = ("int8", "fp32")


def _activations_from_env() -> str:
    mode = os.environ.get("ASYNCENGINE_QUANT_ACTIVATIONS", "int8").strip().lower() or "int8"
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"ASYNCENGINE_QUANT_ACTIVATIONS={mode!r}: expected one of {', '.join(ACTIVATION_MODES)}")
    return mode


# How small-M gemm treats x, read once at import (worker processes inherit the environment).
# Tests and benchmarks pass ``activations=`` to gemm, or set this attribute.
ACTIVATIONS = _activations_from_env()


def row_bytes(qtype: str, k: int) -> int:
    return k // block_len(qtype) * QTYPES[qtype][1]


def check(w: torch.Tensor, qtype: str, k: int) -> int:
    """N, after checking that ``w`` holds N rows of ``k`` values in ``qtype`` blocks."""
    if qtype not in QTYPES:
        raise ValueError(f"unknown block format {qtype!r} (supported: {', '.join(QTYPES)})")
    if k % block_len(qtype):
        raise ValueError(f"{qtype} rows hold blocks of {block_len(qtype)} values; K={k} is not a multiple of "
                         f"{block_len(qtype)}")
    if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != row_bytes(qtype, k):
        raise ValueError(f"{qtype} weight of K={k} must be uint8 [N, {row_bytes(qtype, k)}], "
                         f"got {w.dtype} {list(w.shape)}")
    if not w.is_contiguous():
        raise ValueError("quantized weights must be contiguous")
    return w.shape[0]


def _lib():
    lib = load()
    if lib is not None and not hasattr(lib, "_ae_q_ready"):
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.ae_q_gemm.argtypes = [c_int, ptr, i64, i64, ptr, i64, ptr, ptr, i64, c_int, c_int]
        lib.ae_q_gemm_i8.argtypes = [c_int, ptr, i64, i64, ptr, i64, ptr, ptr, i64, c_int, c_int]
        lib.ae_q_quantize_act.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
        lib.ae_q_quantize_act_k.argtypes = [ptr, i64, i64, ptr, ptr]
        lib.ae_q_dequant.argtypes = [c_int, ptr, i64, i64, i64, ptr, c_int]
        lib.ae_q_embed.argtypes = [c_int, ptr, i64, ptr, i64, ptr, c_int]
        lib.ae_q_gemm_q8.argtypes = [c_int, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, ptr, i64, c_int, c_int]
        lib.ae_q_cpu_isa.argtypes, lib.ae_q_isa.argtypes, lib.ae_q_set_isa.argtypes = [], [], [c_int]
        lib.ae_q_repack_x8.argtypes = lib.ae_q_unpack_x8.argtypes = [c_int, ptr, i64, i64]
        for f in (lib.ae_q_gemm, lib.ae_q_gemm_i8, lib.ae_q_quantize_act, lib.ae_q_quantize_act_k, lib.ae_q_dequant, lib.ae_q_embed,
                  lib.ae_q_gemm_q8, lib.ae_q_cpu_isa, lib.ae_q_isa, lib.ae_q_set_isa, lib.ae_q_repack_x8,
                  lib.ae_q_unpack_x8):
            f.restype = c_int
        lib._ae_q_ready = True
        _apply_isa_env(lib)
    return lib


# ------------------------------------------------------------------------ the int8 kernel's ISA

# The int8 kernel's instruction sets, in quant_i8.c's order (ae_q_cpu_isa): which one runs is chosen
# at run time from what the CPU reports and the OS grants (cpuid + XCR0), the best by default.
ISAS = ("scalar", "avx2", "avx512_vnni")


def _apply_isa_env(lib) -> None:
    """``ASYNCENGINE_CPU_ISA`` = auto | scalar | avx2 | avx512_vnni | avx512_bf16 | amx_bf16 forces a path
    (read at load; avx512_bf16 and amx_bf16, the dense kernels' top levels, are VNNI here)."""
    want = os.environ.get("ASYNCENGINE_CPU_ISA", "auto").strip().lower() or "auto"
    if want in ("avx512_bf16", "amx_bf16"):  # the dense kernels' top levels (isa.py); the int8 kernel's is VNNI
        want = "avx512_vnni"
    if want == "auto":
        return
    if want not in ISAS:
        raise ValueError(f"ASYNCENGINE_CPU_ISA={want!r}: expected auto or one of {', '.join(ISAS)}")
    if lib.ae_q_set_isa(ISAS.index(want)) < 0:
        raise ValueError(f"ASYNCENGINE_CPU_ISA={want}: this CPU (or its OS) cannot execute it; the best it "
                         f"can is {ISAS[lib.ae_q_cpu_isa()]}")


def cpu_isa() -> str | None:
    """The best int8 path this CPU can execute (None without the C library)."""
    lib = _lib()
    return None if lib is None else ISAS[lib.ae_q_cpu_isa()]


def isa() -> str | None:
    """The int8 path in use (None without the C library)."""
    lib = _lib()
    return None if lib is None else ISAS[lib.ae_q_isa()]


def set_isa(name: str) -> str:
    """Force the int8 path (``"auto"``: the best this CPU can execute); returns the one now in use.
    Raises where the CPU cannot execute it or the library is not built."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("the CPU kernels are not built: there is no ISA to choose")
    if name != "auto" and name not in ISAS:
        raise ValueError(f"unknown ISA {name!r} (auto or one of {', '.join(ISAS)})")
    if lib.ae_q_set_isa(-1 if name == "auto" else ISAS.index(name)) < 0:
        raise ValueError(f"this CPU cannot execute {name}; the best it can is {ISAS[lib.ae_q_cpu_isa()]}")
    return ISAS[lib.ae_q_isa()]


def kernels_available() -> bool:
    return _lib() is not None


# --------------------------------------------------------------------------------- torch references


def dequantize_torch(w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """fp32 [N, k], exactly as ggml dequantizes (q * d + m; (q - 8) * d; q * d; K-quants: d * sc * q - dmin * m)."""
    n = w.shape[0]
    if qtype in K_QUANTS:  # gguf-py's values (llama.cpp's), imported only here
        import gguf.quants

        out = gguf.quants.dequantize(w.contiguous().numpy(), gguf.GGMLQuantizationType[qtype])
        return torch.from_numpy(out.astype("float32", copy=False).reshape(n, k))
    b = w.reshape(-1, QTYPES[qtype][1])
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    if qtype == "Q8_0":
        out = b[:, 2:].contiguous().view(torch.int8).float() * d
    else:
        qs = b[:, 4:] if qtype == "Q4_1" else b[:, 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()  # elements 0-15, then 16-31
        if qtype == "Q4_1":
            out = q * d + b[:, 2:4].contiguous().view(torch.float16).float()
        else:
            out = (q - 8.0) * d
    return out.reshape(n, k)


def x8_torch(w: torch.Tensor, qtype: str, k: int, inverse: bool = False) -> torch.Tensor:
    """The x8 layout in torch (a copy): the reference the C repacking is tested against, and how the
    torch fallbacks read a packed weight. ``inverse``: x8 -> rows. (Groups of 8 rows; quants in
    8-byte chunks: a chunk of each of the group's 8 rows per 64 bytes.)"""
    n, bs = w.shape[0], QTYPES[qtype][1]
    nb, g = k // BLOCK, n // 8
    hdr, chunks = (4 if qtype == "Q4_1" else 2), (4 if qtype == "Q8_0" else 2)
    if not inverse:
        t = w.reshape(g, 8, nb, bs).permute(0, 2, 1, 3)  # [g, nb, row, bs]
        parts = [t[..., 0:2].reshape(g, nb, 16)] + ([t[..., 2:4].reshape(g, nb, 16)] if qtype == "Q4_1" else [])
        q = t[..., hdr:].reshape(g, nb, 8, chunks, 8).permute(0, 1, 3, 2, 4).reshape(g, nb, chunks * 64)
        return torch.cat(parts + [q], dim=-1).reshape(n, nb * bs).contiguous()
    t = w.reshape(g, nb, 8 * bs)
    parts = [t[..., 0:16].reshape(g, nb, 8, 2)]
    if qtype == "Q4_1":
        parts.append(t[..., 16:32].reshape(g, nb, 8, 2))
    q = t[..., 8 * hdr:].reshape(g, nb, chunks, 8, 8).permute(0, 1, 3, 2, 4).reshape(g, nb, 8, chunks * 8)
    rows = torch.cat(parts + [q], dim=-1)  # [g, nb, row, bs]
    return rows.permute(0, 2, 1, 3).reshape(n, nb * bs).contiguous()


def quantize_activations_torch(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [M, K] -> (q int8 [M, K], d fp32 [M, K/32], s fp32 [M, K/32]) exactly as quant_i8.c's
    int8 path does it: d = max|x| / 127, q = rint(x * (1 / d)) (ties to even), s = d * sum(q)."""
    m, k = x2.shape
    blocks = x2.to(torch.float32).reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127
    q = torch.round(blocks * _inverse(d).unsqueeze(-1)).to(torch.int8)
    s = d * q.sum(-1, dtype=torch.int32).to(torch.float32)
    return q.reshape(m, k), d, s


def quantize(w: torch.Tensor, qtype: str, rows_per_chunk: int = 4096) -> torch.Tensor:
    """Dense [N, K] (K a multiple of 32) -> uint8 blocks, byte-identical to gguf-py's quantizer
    (ggml's reference rounding). Works a chunk of rows at a time to bound the scratch memory."""
    n, k = w.shape
    if qtype in K_QUANTS:
        raise ValueError(f"{qtype} weights come from GGUF files as they are; there is no {qtype} quantizer here")
    if k % BLOCK:
        raise ValueError(f"{qtype} needs rows of whole blocks of {BLOCK}; K={k} is not a multiple of {BLOCK}")
    out = torch.empty(n, row_bytes(qtype, k), dtype=torch.uint8)
    for r0 in range(0, n, rows_per_chunk):
        blocks = w[r0:r0 + rows_per_chunk].detach().to(torch.float32).reshape(-1, BLOCK)
        out[r0:r0 + rows_per_chunk] = _quantize_blocks(blocks, qtype).reshape(-1, out.shape[1])
    return out


# ------------------------------------------------------------------------------------- the kernels


def dequantize(w: torch.Tensor, qtype: str, k: int, packed: bool = False) -> torch.Tensor:
    """fp32 [N, k] (the C kernel, multi-threaded, where available)."""
    n = check(w, qtype, k)
    lib = _lib()
    if lib is None:
        return dequantize_torch(_rows(w, qtype, k, packed), qtype, k)
    out = torch.empty(n, k, dtype=torch.float32)
    lib.ae_q_dequant(type_id(qtype, packed), w.data_ptr(), k, 0, n, out.data_ptr(), torch.get_num_threads())
    return out


def embedding(ids: torch.Tensor, w: torch.Tensor, qtype: str, k: int, packed: bool = False) -> torch.Tensor:
    """fp32 rows ``dequant(W)[ids]``, shape ``ids.shape + (k,)``. Ids must be in range (checked)."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= w.shape[0]):
        raise IndexError(f"token id out of range for an embedding of {w.shape[0]} rows")
    lib = _lib()
    if lib is None:
        rows = _rows(w, qtype, k, packed)
        out = dequantize_torch(rows.index_select(0, flat), qtype, k)
    else:
        out = torch.empty(flat.numel(), k, dtype=torch.float32)
        lib.ae_q_embed(type_id(qtype, packed), w.data_ptr(), k, flat.data_ptr(), flat.numel(), out.data_ptr(),
                       torch.get_num_threads())
    return out.view(*ids.shape, k)


def quantize_activations(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The C kernel's own int8 blocks of a contiguous fp32 [M, K] (what :func:`gemm` multiplies
    with at ``activations="int8"``); the torch reference where the library is not built."""
    lib = _lib()
    if lib is None:
        return quantize_activations_torch(x2)
    x2 = x2.to(torch.float32).contiguous()
    m, k = x2.shape
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}")
    q = torch.empty(m, k, dtype=torch.int8)
    d, s = torch.empty(m, k // BLOCK), torch.empty(m, k // BLOCK)
    lib.ae_q_quantize_act(x2.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q, d, s


def gemm(x: torch.Tensor, w: torch.Tensor, qtype: str, k: int, bias: torch.Tensor | None = None,
         activations: str | None = None, fixed_order: bool = False, packed: bool = False) -> torch.Tensor:
    """``x @ dequant(w)^T (+ bias)`` over the last dim of ``x`` (any float dtype; the math is fp32,
    the result is in ``x``'s dtype). ``w`` must have passed :func:`check`. ``activations``
    ("int8" | "fp32", default :data:`ACTIVATIONS`): "int8" runs the integer kernel at every M (one
    numeric path whatever the batch; it also beats the tiled path 2x at M = 512), "fp32" the exact
    kernel below ``LARGE_M`` rows and the tiled path from there. Without the C library: exact.
    ``fixed_order`` (batch-invariant mode) keeps the exact kernel at every M in fp32 too: each output
    is one dot product in a fixed order there, while the tiled path's ``torch.mm`` blocks by M.
    ``packed``: ``w`` is in the x8 layout (``repack.pack``); the results are the same bits."""
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {k}")
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.to(torch.float32).contiguous()
    m = x2.shape[0]
    lib = _lib()
    mode = _mode(activations)
    if lib is None:
        out = gemm_torch(x2, _rows(w, qtype, k, packed), qtype, k, bias)
    elif mode == "fp32" and m >= LARGE_M and not fixed_order:
        out = _gemm_tiled(lib, x2, w, qtype, k, bias, packed)
    else:
        out = torch.empty(m, n, dtype=torch.float32)
        b = None
        if bias is not None:
            b = bias if bias.dtype == torch.float32 and bias.is_contiguous() else bias.float().contiguous()
        kernel = lib.ae_q_gemm_i8 if mode == "int8" else lib.ae_q_gemm
        if kernel(type_id(qtype, packed), x2.data_ptr(), m, k, w.data_ptr(), n, None if b is None else b.data_ptr(),
                  out.data_ptr(), n, 0, torch.get_num_threads()):
            raise MemoryError(f"quantized gemm of {m} x {k} rows failed (out of memory for the int8 copy?)")
    out = out.view(*x.shape[:-1], n)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _mode(activations: str | None) -> str:
    mode = ACTIVATIONS if activations is None else activations
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"activations={mode!r}: expected one of {', '.join(ACTIVATION_MODES)}")
    return mode


def gemm_small_m(x2: torch.Tensor, w: torch.Tensor, qtype: str, k: int, activations: str | None = None,
                 packed: bool = False) -> torch.Tensor:
    """The register-blocked kernel for any M (benchmarks compare it with the tiled path)."""
    lib = _lib()
    out = torch.empty(x2.shape[0], w.shape[0], dtype=torch.float32)
    kernel = lib.ae_q_gemm_i8 if _mode(activations) == "int8" else lib.ae_q_gemm
    kernel(type_id(qtype, packed), x2.data_ptr(), x2.shape[0], k, w.data_ptr(), w.shape[0], None,
                  out.data_ptr(), w.shape[0], 0, torch.get_num_threads())
    return out


def _gemm_tiled(lib, x2, w, qtype, k, bias, packed=False):
    """Large M: W dequantized a tile of rows at a time (C) into fp32 scratch, then torch.mm."""
    n = w.shape[0]
    rows = max(1, min(n, _TILE_BYTES // (4 * k)))
    scratch = torch.empty(rows, k, dtype=torch.float32)
    tid, nt = type_id(qtype, packed), torch.get_num_threads()
    if rows == n:
        lib.ae_q_dequant(tid, w.data_ptr(), k, 0, n, scratch.data_ptr(), nt)
        return torch.mm(x2, scratch.t()) if bias is None else torch.addmm(bias.float(), x2, scratch.t())
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        lib.ae_q_dequant(tid, w.data_ptr(), k, n0, n1, scratch.data_ptr(), nt)
        out[:, n0:n1] = torch.mm(x2, scratch[:n1 - n0].t())
    if bias is not None:
        out += bias.float()
    return out


def gemm_torch(x2: torch.Tensor, w: torch.Tensor, qtype: str, k: int, bias=None) -> torch.Tensor:
    """The fallback without the C library: dequantize a tile of rows per call, then torch.mm."""
    n = w.shape[0]
    rows = max(1, min(n, _TILE_BYTES // (4 * k)))
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    for n0 in range(0, n, rows):
        out[:, n0:n0 + rows] = torch.mm(x2, dequantize_torch(w[n0:n0 + rows], qtype, k).t())
    if bias is not None:
        out += bias.float()
    return out
