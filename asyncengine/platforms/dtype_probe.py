"""Which floating-point type this CPU multiplies fastest, measured, not read off a CPU flag.

Flags lie both ways on machines of our kind: an Intel Xeon advertising avx512_bf16 ran bf16 GEMM at
half its fp32 rate, an AMD EPYC ran it at 4x, and an AVX2-only EPYC at 1/60. So ``dtype="auto"``
on CPU runs a short GEMM probe (a few tens of milliseconds; a slow type is cut off after one call)
and caches the answer per machine (CPU model and flags, torch version, thread count) in
``$ASYNCENGINE_CACHE/probe.json``: later starts read a file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# bf16 must beat fp32 by this much to be picked: it also costs precision (fp32 is the parity reference)
BF16_MIN_SPEEDUP = 1.3
_SIZE = 256  # m = k = n: big enough for the GEMM kernels to show their rate, small enough to be quick
_BUDGET_S = 0.03  # per dtype, after one warm-up call


def _cache_file() -> Path:
    from asyncengine.platforms.paths import cache_dir  # lazy: only when the probe's cache is written

    return cache_dir() / "probe.json"


def machine_key() -> str:
    """The facts the probe's answer depends on."""
    model, flags = platform.processor(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = line.split(":", 1)[1]
                    break
    except OSError:
        pass
    facts = f"{model}|{flags.strip()}|{torch.__version__}|{torch.get_num_threads()}"
    return hashlib.sha256(facts.encode()).hexdigest()[:16]


def gemm_gflops(dtype: torch.dtype, size: int = _SIZE, budget_s: float = _BUDGET_S) -> float:
    """GFLOP/s of a size^3 matmul in ``dtype`` on this CPU (0.0 when the type does not run)."""
    try:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        a[:16, :16] @ b[:16, :16]  # first-use costs (library init, thread pool) outside the timing
        t0 = time.perf_counter()
        a @ b  # one full call first: a very slow type is judged on it alone
        first = time.perf_counter() - t0
        if first > 10 * budget_s:  # hopeless: do not spend more time on it
            return 2 * size ** 3 / first / 1e9
        reps, t0 = 0, time.perf_counter()
        while True:
            a @ b
            reps += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= budget_s:
                return 2 * size ** 3 * reps / elapsed / 1e9
    except RuntimeError:
        return 0.0


def measure() -> dict:
    rates = {"float32": gemm_gflops(torch.float32), "bfloat16": gemm_gflops(torch.bfloat16)}
    best = "bfloat16" if rates["bfloat16"] >= BF16_MIN_SPEEDUP * rates["float32"] else "float32"
    return {"gflops": rates, "dtype": best, "threads": torch.get_num_threads()}


def probe(use_cache: bool = True) -> dict:
    """The measured GEMM rates and the pick, from the per-machine cache when there."""
    key = machine_key()
    path = _cache_file()
    cached: dict = {}
    if use_cache:
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
        if isinstance(cached.get(key), dict) and cached[key].get("dtype") in ("float32", "bfloat16"):
            return cached[key]
    result = measure()
    log.info("dtype probe: fp32 %.0f GFLOP/s, bf16 %.0f GFLOP/s -> %s", result["gflops"]["float32"],
             result["gflops"]["bfloat16"], result["dtype"])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cached[key] = result
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: measure again next time
        log.debug("could not cache the dtype probe: %s", exc)
    return result


def fastest_cpu_dtype() -> torch.dtype:
    return torch.bfloat16 if probe()["dtype"] == "bfloat16" else torch.float32
