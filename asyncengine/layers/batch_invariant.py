"""Batch-invariant mode (``EngineConfig.batch_invariant``): which kernels a model runs so that each
row's result has the same bits whatever else is in the batch, and the check that they are there.

Invariance is a property of the kernels, chosen here once per model at load:

* dense projections and the LM head: ``kernels/cpu/invariant.c`` (one fixed reduction order per
  output, threads split N never K) instead of the BLAS, whose blocking follows M;
* quantized projections: the C kernels' per-row path at every M (``quant.gemm(fixed_order=True)``:
  no dequantize-into-``torch.mm`` route from ``quant.LARGE_M`` rows up);
* attention: the C paged kernel for every chunk length (``CpuBackend``: each query row walks its
  keys block by block in position order, so prefill, decode, an earlier chunk or the prefix cache
  give the same bits); the torch backend's long-prefill route is never taken;
* tensor parallelism: all-reduce as gather + sum in rank order (``TPGroup.fixed_order``).

RMSNorm, rotary and SiLU-and-mul (``kernels/cpu/ops.c``) are per row in a fixed order already, and
torch's CPU ``log_softmax``/``softmax`` reduce each row alone (tests/layers/test_batch_invariant.py
holds all of these to it).
"""
from __future__ import annotations

from torch import nn

from asyncengine.errors import ConfigError
from asyncengine.layers.linear import Linear


def require_kernels() -> None:
    """Invariant mode needs the C kernels: the torch fallbacks (dequantize + ``torch.mm``, the torch
    attention backend) let the BLAS pick its blocking from the batch."""
    from asyncengine.kernels.cpu import build_error, load  # lazy: the kernels build/load (C compile, triton) only on this path

    if load() is None:
        raise ConfigError("batch_invariant=True needs the CPU C kernels, which are unavailable here: "
                          f"{build_error() or 'not built'}")


def enable(model: nn.Module) -> None:
    """Route every projection of ``model`` (and its LM head) through the fixed-order kernels."""

    require_kernels()
    for m in model.modules():
        if isinstance(m, Linear):
            m.batch_invariant = True


def check_backend(backend) -> None:
    """Refuse an attention backend that cannot keep a row's bits independent of the batch."""
    if not getattr(backend, "supports_batch_invariant", False):
        raise ConfigError(f"batch_invariant=True needs the 'cpu' attention backend with its C kernels; "
                          f"{backend.name!r} has no batch-invariant mode")
