"""A capacity for oneDNN's per-shape primitive caches, set before torch first runs oneDNN.

Why (issue 22, "Memory per shape"; docs/benchmarks.md, "Soak"): a bf16 GEMM on CPU runs through
oneDNN, which JIT-compiles a *primitive* for each problem shape (M x K x N) and keeps it in two
caches, both 1,024 entries by default: oneDNN's own (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and the
one torch's ideep layer keeps beside it (``LRU_CACHE_CAPACITY``); only both bounded bound the
memory. M is a step's batched token count, so a server sees hundreds of them. Measured on a 2-vCPU
AMD EPYC (AVX-512 BF16, torch 2.13, oneDNN 3.12): a cached primitive holds ~0.55 MiB of malloc
memory (~0.65 MiB of RSS) whatever the weight's shape (64x64 to 49152x576). A 4,000-request bf16
soak of the tiny model with prompts of 1-200 tokens (benchmarks/results/soak_memory.json) grew the
idle server from 697 MB after its warm-up to 1,159 MB: malloc in use 390 -> 660 MB (flat once the
caches were full), free memory inside malloc's arenas 67 -> 255 MB and still growing (the churn of
a full cache fragments the heap), Python's object count flat. fp32 GEMMs go through MKL: flat.

Bound: :data:`CAPACITY` entries in each cache (~0.55 MiB x CAPACITY at most). The same soak then
stays at 477 -> 482 MB (malloc in use 186 MB, free 55-59 MB, both flat). A new shape costs a JIT
compile of ~0.1-0.4 ms per GEMM; a Llama step has ~5 GEMM shapes (qkv, o, gate_up, down, head),
so 128 entries keep ~25 batch sizes warm, and decode steps (whose M changes only as requests come
and go) still hit. It costs no speed: on the offline workload (bench model, bf16, 1 thread,
interleaved rounds) 128 ran 1.18-1.32x the out tok/s of 1,024 in 3 rounds at load 3-5 and within
the noise of 1,024 and 256 in 2 rounds at load 5-7: a bounded cache reuses the memory of the
primitives it evicts, where an unbounded one faults in fresh pages for each (191 vs 53-96 minor
faults per new primitive, measured). No malloc setting is needed on top: with the bound, the
arenas (5-6) and the free memory inside them stay flat over the soak.

Both variables are read once, when each cache is first used, so :func:`bound_onednn_caches` must run
before the process's first oneDNN call: the engine calls it where it resolves the CPU device (before
the dtype probe's GEMMs) and in every worker's start-up, and exports the variables so that processes
it spawns inherit them. An app that runs bf16 GEMMs itself before it builds the engine must set
the variables (or call this function) before its own first one. A value the user set wins;
``LRU_CACHE_CAPACITY=0`` crashes torch 2.13 (a segfault at the first bf16 GEMM, measured), so 0 is
raised to 1.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

CAPACITY = 128
VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = CAPACITY) -> dict[str, str]:
    """Set each cache's capacity in this process's environment unless the user did; returns the
    values now in effect for a cache not yet created. Idempotent."""
    for name in VARIABLES:
        value = os.environ.get(name, "").strip()
        if not (value.isascii() and value.isdigit()):  # str.isdigit() alone takes "²"
            if value:
                log.warning("%s=%r is not a number: using %d", name, value, capacity)
            os.environ[name] = str(capacity)
        elif name == "LRU_CACHE_CAPACITY" and int(value) == 0:
            os.environ[name] = "1"  # 0 makes torch's ideep cache crash at its first GEMM
        else:
            os.environ[name] = str(int(value))  # as C's atoi reads it: no spaces, no leading zeros
    return {name: os.environ[name] for name in VARIABLES}
