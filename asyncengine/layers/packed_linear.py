"""Dense CPU projections through oneDNN with the weight reordered once, at load, into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what torch's own
CPU freezing pass and vLLM's CPU build use) instead of ``F.linear``.

Why: ``F.linear`` reorders the weight on every call for bf16 and, for fp32, runs MKL's sgemm,
which takes a slow path on AMD CPUs. Measured on the 2-vCPU EPYC (Zen 5, AVX512-BF16), one thread,
bench-model shapes (K 512/1408, N 512-2816): bf16 1.9x faster at 1 row, ~5% at 200 rows; fp32
2.4-4x faster at 200-2,048 rows, 5x for the 32,000-row LM head. bf16 results are bit-identical to
``F.linear``'s; fp32 ones differ in summation order only (~1e-7 relative).

The packed copy sits beside the dense parameter (the embedding, tied heads and the loader keep
reading that one): the model's dense weights take twice their bytes in memory. So the copies are
made only while they fit in a quarter of the memory available at load (``MEMORY_SHARE``): a small
model gets the speed, a large one is never pushed out of memory by it (it logs what it skipped).
Off with ``ASYNCENGINE_PREPACK=0``; never in the batch-invariant mode, whose linears have their own
kernel.

Row buckets (:func:`bucket_rows`): oneDNN builds (JIT-compiles) one primitive per input shape, ~3 ms
each here, and keeps CAPACITY of them (128: platforms/onednn_caches.py). A serving step's row count
is the running sequences plus a prefill chunk: nearly every step brings a new M, so nearly every step
compiled its projections' kernels again (py-spy, offline workload, bench model, bf16, Xeon AMX:
primitive creation 7.5% of the model thread). Rows above ``EXACT_ROWS`` are padded up to one of 16
sizes per power of two (at most 1/16 more rows, ~3% on average): far fewer shapes, so far more hits
(4.1% of the thread left compiling on the same run). The zero rows are dropped from the result; in bf16 the real rows keep F.linear's
bits (tests/layers/test_packed_linear.py), in fp32 they may differ in summation order only, as
between any two row counts. Measured, offline workload, same sitting, interleaved: +1.5% to +7.7%
output tok/s over 4 pairs.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

from asyncengine.platforms.host_memory import host_available_bytes

log = logging.getLogger(__name__)

# the packed copies may take at most this share of the memory available when the model is loaded
MEMORY_SHARE = 0.25

# rows the blocked layout is chosen for (oneDNN picks its blocking from it; any M runs with it)
ROWS_HINT = 256

# row counts up to this run as they are (decode batches: a few shapes, compiled once); above it,
# ROW_BUCKETS_PER_OCTAVE sizes per power of two
EXACT_ROWS = 32
ROW_BUCKETS_PER_OCTAVE = 16


def enabled() -> bool:
    return os.environ.get("ASYNCENGINE_PREPACK", "1").strip().lower() not in ("0", "false", "no", "off")


def available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def available_memory_bytes() -> int:
    """Host memory available now (0 if the OS does not say: then nothing is packed)."""
    return host_available_bytes() or 0


def fits(count: int, need: int) -> bool:
    """Whether ``count`` packed copies of ``need`` bytes in all fit MEMORY_SHARE of the memory
    available now (if not, it logs what is skipped)."""
    budget = int(MEMORY_SHARE * available_memory_bytes())
    if need > budget:
        log.warning("not packing %d dense projections for oneDNN: the copies (%.0f MiB) would exceed "
                    "%d%% of the memory available (%.0f MiB)", count, need / 2**20,
                    round(100 * MEMORY_SHARE), budget / 2**20)
    return need <= budget


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in oneDNN's blocked layout (an opaque tensor for :func:`linear`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x W^T (+ b)`` with a weight from :func:`pack`; x [..., K], any leading dims."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    mb = bucket_rows(m)
    if mb != m:  # zero rows up to the bucket (new_empty + copy: F.pad costs twice as much here)
        padded = x2.new_empty((mb, x2.shape[1]))
        padded[:m].copy_(x2)
        padded[m:].zero_()
        x2 = padded
    y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    if mb != m:
        y = y[:m]
    return y.view(*lead, out_features)


def linear_epilogue(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` then exact (erf) GELU, or ``+ residual``, inside oneDNN's GEMM epilogue: the
    output is written once instead of once per elementwise pass (bias, GELU, add). x [M, K]
    contiguous; rows are not bucketed here (the caller pads M: models/bert.py pads a whole batch
    once). GELU's bits equal ``F.gelu(F.linear(...))``'s; the add may differ in summation order only."""
    if residual is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
    if gelu:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "gelu", [], "none")
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def bucket_rows(m: int) -> int:
    """The row count a product of ``m`` rows runs with: ``m`` up to EXACT_ROWS, else ``m`` rounded up
    to a multiple of 2**(floor(log2 m)) / ROW_BUCKETS_PER_OCTAVE (so at most 1/16 more rows)."""
    if m <= EXACT_ROWS:
        return m
    step = max(1, (1 << (m.bit_length() - 1)) // ROW_BUCKETS_PER_OCTAVE)
    return -(-m // step) * step


def prepack(model: nn.Module) -> int:
    """Pack every dense CPU projection of ``model`` in bf16 or fp32 (call once its weights are
    loaded, before it runs); returns how many were packed. A projection is a module with an
    ``onednn_weight`` slot (``layers.linear.Linear``; not imported here: linear.py imports this module)."""
    if not enabled() or not available():
        return 0
    todo = []
    for m in model.modules():
        if not hasattr(type(m), "onednn_weight") or m.quantized or m.batch_invariant:
            continue
        w = m.weight
        if w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float32) or w.dim() != 2:
            continue
        if m.bias is not None and m.bias.dtype != w.dtype:
            continue
        todo.append(m)
    need = sum(m.weight.numel() * m.weight.element_size() for m in todo)
    if not fits(len(todo), need):
        return 0
    for m in todo:
        m.onednn_weight = pack(m.weight)
    if todo:
        log.info("packed %d dense projections for oneDNN (%.0f MiB)", len(todo), need / 2**20)
    return len(todo)
