#!/usr/bin/env python
"""Two (or more) builds of the CPU kernels, side by side in one process, on attention_kernels.py's
cases: each round runs every case on every build in turn, so the host's load moves them together.

    python benchmarks/kernel_builds_ab.py --lib old=PATH.so --lib new=PATH.so \\
        [--cases prefill_d64,prefill_d128] [--level amx_bf16] [--rounds 9] [--out result.json]

Why: on a shared host the matmul peak moved 790-2,600 GFLOP/s within an hour, so separate runs of
attention_kernels.py cannot resolve a 5-15% kernel change; alternating builds every few
milliseconds can. A build is the library the kernels compile into (one per source version, kept
in ~/.cache/asyncengine/kernels): check out the sources, then
``python -c "from asyncengine.kernels.cpu import build; build.load(); print(build._lib._name)"``
prints its path. Every build runs at ``--level`` (each library keeps its own ISA setting).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_kernels import CASES, case  # noqa: E402
from single_stream import cpu_info  # noqa: E402


def bound(path: str, signatures: dict, level: str) -> dict:
    """The attention functions of the library at ``path``, at ISA level ``level``."""
    from asyncengine.kernels.cpu import build

    lib = ctypes.CDLL(path)
    build.set_isa_level(lib, level, "--level")
    return build.bind(signatures, lib)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", action="append", required=True, help="NAME=PATH of a built kernel library")
    ap.add_argument("--cases", default="prefill_d64,prefill_d128")
    ap.add_argument("--level", default="auto", help="ISA level every build runs at")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=5, help="calls per case, build and round")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from asyncengine.kernels.cpu import attention as A

    if not A.available():
        sys.exit("the CPU kernels did not build here")
    libs = {}
    for spec in args.lib:
        name, _, path = spec.partition("=")
        libs[name] = bound(path, A._lib.signatures, args.level)
    cases = {name: case(**CASES[name]) for name in args.cases.split(",")}
    times: dict[tuple[str, str], list[float]] = {(c, b): [] for c in cases for b in libs}
    try:
        for _ in range(args.rounds):
            for cname, (run, _, _) in cases.items():
                for bname, fns in libs.items():
                    A._lib._fns = fns  # attention.py calls through this binding
                    run()
                    t0 = time.perf_counter()
                    for _ in range(args.reps):
                        run()
                    times[cname, bname].append((time.perf_counter() - t0) / args.reps)
    finally:
        A._lib.reset()
    rows = []
    for (cname, bname), ts in times.items():
        _, flops, kv = cases[cname]
        med = statistics.median(ts)
        rows.append(dict(case=cname, build=bname, ms=round(med * 1e3, 3), ms_min=round(min(ts) * 1e3, 3),
                         ms_max=round(max(ts) * 1e3, 3), gflops=round(flops / med / 1e9, 1),
                         gbs=round(kv / med / 1e9, 2)))
        print(f"{cname:22} {bname:10} {med * 1e3:9.3f} ms ({min(ts) * 1e3:.3f}-{max(ts) * 1e3:.3f}) "
              f"{flops / med / 1e9:8.1f} GFLOP/s {kv / med / 1e9:6.2f} GB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(cpu=cpu_info(), level=args.level, rounds=args.rounds, libs=dict(
                spec.partition("=")[::2] for spec in args.lib), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
