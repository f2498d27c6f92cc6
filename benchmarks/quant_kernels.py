#!/usr/bin/env python
"""The quantized-weight kernels against the machine's read bandwidth and against dense fp32.

    python benchmarks/quant_kernels.py [--threads 2] [--repeat 30] [--only SECTION] [--out result.json]

Figures (best of --repeat, so a busy machine disturbs them less; still say when it was busy):

  read_gb_s      torch.sum over a 1 GiB fp32 tensor: the bandwidth that bounds single-stream decode
  gemv           per shape of SmolLM2-135M (M = 1): the kernel's time, its effective GB/s of weight
                 bytes, and dense fp32 F.linear's time on the same (dequantized) weight
  crossover      per M: the register-blocked kernel vs the tiled path (blocks dequantized into fp32
                 scratch, then torch.mm); kernels/cpu/quant.py's LARGE_M is where the tiled path wins
  activations    per shape, M = 1 (decode) and 37 (a chat prompt's prefill): the small-M kernel with
                 fp32 activations vs int8 activations (ASYNCENGINE_QUANT_ACTIVATIONS), and the ratio
  layout         per shape, M = 1, 32 (the native step's largest), 512 (a long prefill): the int8
                 kernel on the file's row layout vs the x8 layout (kernels/cpu/repack.py)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


SHAPES = [  # (N, K, format): SmolLM2-135M's projections and its tied Q8_0 head
    (960, 576, "Q4_1"), (576, 576, "Q4_1"), (3072, 576, "Q4_1"), (576, 1536, "Q4_1"), (49152, 576, "Q8_0")]


def best(f, repeat: int) -> float:
    f()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--only", default=None, choices=["read_gb_s", "gemv", "crossover", "activations", "layout"],
                    help="run one section of the figures below (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    want = lambda section: args.only in (None, section)  # noqa: E731
    import torch
    import torch.nn.functional as F

    from asyncengine.kernels.cpu import quant, repack

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    res = {"threads": args.threads, "load_avg": os.getloadavg()}
    if want("read_gb_s"):
        big = torch.ones(1 << 28)  # 1 GiB
        res["read_gb_s"] = big.numel() * 4 / best(lambda: big.sum(), max(3, args.repeat // 5)) / 1e9
        del big
    res["gemv"] = []
    for n, k, q in SHAPES if want("gemv") else []:
        blocks = quant.quantize(torch.randn(n, k), q)
        dense = quant.dequantize(blocks, q, k)
        x = torch.randn(1, k)
        t = best(lambda: quant.gemm(x, blocks, q, k, activations="fp32"), args.repeat)
        td = best(lambda: F.linear(x, dense), args.repeat)
        res["gemv"].append({"shape": [n, k], "format": q, "us": t * 1e6, "weight_gb_s": blocks.numel() / t / 1e9,
                            "dense_fp32_us": td * 1e6})
    res["crossover"] = []
    for n, k, q in [(3072, 576, "Q4_1"), (576, 1536, "Q4_1"), (49152, 576, "Q8_0")] if want("crossover") else []:
        blocks = quant.quantize(torch.randn(n, k), q)
        for m in (8, 16, 32, 48, 64, 128, 256):
            x = torch.randn(m, k)
            r = max(3, args.repeat // 5)
            tk = best(lambda: quant.gemm_small_m(x, blocks, q, k, activations="fp32"), r)
            tt = best(lambda: quant._gemm_tiled(quant._lib(), x, blocks, q, k, None), r)
            res["crossover"].append({"shape": [n, k], "format": q, "m": m, "kernel_us": tk * 1e6,
                                     "tiled_us": tt * 1e6})
    res["activations"] = []
    for n, k, q in SHAPES if want("activations") else []:
        blocks = quant.quantize(torch.randn(n, k), q)
        for m in (1, 37):
            x = torch.randn(m, k)
            r = max(3, args.repeat // (5 if n * m > 1 << 20 else 1))
            tf = best(lambda: quant.gemm_small_m(x, blocks, q, k, activations="fp32"), r)
            ti = best(lambda: quant.gemm_small_m(x, blocks, q, k, activations="int8"), r)
            res["activations"].append({"shape": [n, k], "format": q, "m": m, "fp32_us": tf * 1e6,
                                       "int8_us": ti * 1e6, "speedup": tf / ti})
    res["layout"] = []
    for n, k, q in SHAPES if want("layout") else []:
        blocks = quant.quantize(torch.randn(n, k), q)
        packed = blocks.clone()
        repack.pack(packed, q, k)
        for m in (1, 32, 512):
            x = torch.randn(m, k)
            r = max(3, args.repeat // (10 if n * m > 1 << 20 else 1))
            tr = best(lambda: quant.gemm(x, blocks, q, k, activations="int8"), r)
            tx = best(lambda: quant.gemm(x, packed, q, k, activations="int8", packed=True), r)
            res["layout"].append({"shape": [n, k], "format": q, "m": m, "rows_us": tr * 1e6, "x8_us": tx * 1e6,
                                  "speedup": tr / tx, "x8_weight_gb_s": blocks.numel() / tx / 1e9})
    from single_stream import cpu_info

    res["command"] = "python benchmarks/quant_kernels.py " + " ".join(sys.argv[1:])
    res["cpu"] = cpu_info()
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
