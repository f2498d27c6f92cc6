"""K-quant GEMMs (Q4_K, Q6_K) against the Q4_0 / Q8_0 kernels (x8 layout) at decode-sized M:
microseconds per call, interleaved rounds (format A, B, C, ... per round), median and spread.

    python benchmarks/kquant_kernels.py --threads 2 --rounds 7
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from asyncengine.kernels.cpu import quant, repack

SHAPES = {"qkv 3072 x 2048": (3072, 2048), "down 2048 x 8192": (2048, 8192)}
FORMATS = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")


def blocks(qtype: str, n: int, k: int) -> tuple[torch.Tensor, bool]:
    w = torch.randn(n, k) / k ** 0.5
    if qtype in quant.K_QUANTS:
        import sys

        sys.path.insert(0, "tests")
        from gguf_utils import quantize_k

        return torch.from_numpy(quantize_k(w.numpy(), qtype)), False
    b = quant.quantize(w, qtype)
    packed = repack.can_pack(n, qtype)
    if packed:
        repack.pack(b, qtype, k)
    return b, packed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"int8 path: {quant.isa()}, threads {args.threads}")
    for label, (n, k) in SHAPES.items():
        ws = {q: blocks(q, n, k) for q in FORMATS}
        for m in args.m:
            x = torch.randn(m, k)
            times: dict[str, list[float]] = {q: [] for q in FORMATS}
            for _ in range(args.rounds):
                for q in FORMATS:
                    w, packed = ws[q]
                    for _ in range(3):
                        quant.gemm(x, w, q, k, activations="int8", packed=packed)
                    t0 = time.perf_counter()
                    reps = 20
                    for _ in range(reps):
                        quant.gemm(x, w, q, k, activations="int8", packed=packed)
                    times[q].append((time.perf_counter() - t0) / reps * 1e6)
            cells = []
            for q in FORMATS:
                t = times[q]
                gbs = ws[q][0].numel() / (statistics.median(t) * 1e-6) / 1e9
                cells.append(f"{q} {statistics.median(t):.0f} us [{min(t):.0f}-{max(t):.0f}] {gbs:.1f} GB/s")
            print(f"{label}, M={m}: " + " | ".join(cells))


if __name__ == "__main__":
    np.random.seed(0)
    main()
