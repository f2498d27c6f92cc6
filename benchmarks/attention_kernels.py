#!/usr/bin/env python
"""The CPU paged-attention kernel alone, per ISA path, against this machine's measured peaks.

    python benchmarks/attention_kernels.py [--rounds 5] [--threads N] [--out result.json]

Cases (bf16 caches, GQA 4:1, blocks of 16 shuffled so no sequence's blocks are contiguous):

  prefill  one fresh sequence of 512 tokens (512 query rows x 512 keys, causal), head dim 64
           (16 query / 4 KV heads) and 128 (32 / 8): GFLOP/s of the causal work
           (4 * D flops per query head and visible key: QK^T and PV)
  decode   256 sequences x 1,024 cached keys, one query row each: GB/s of K/V read
           (2 * D * 2 bytes per KV head and key), and GFLOP/s
  decode_bench8  the offline workload's decode (bench-model heads, GQA 2): 200 sequences x 400
           keys over 8 layers' caches (655 MB: from DRAM, not the LLC)
  decode_bench8_inorder  the same with each sequence's blocks in order, as the engine mostly lays
           them out (benchmarks/block_layout.py: 76% of a table's neighbours are consecutive blocks
           on the offline workload, 85% in its decode-heavy steps)

Caches are allocated as the engine allocates them (attention/kv_cache.py).

Peaks, measured in the same run with the same threads:
  matmul   bf16 torch.matmul 2048 x 2048 x 2048 (oneDNN: AMX tiles where the CPU has them), best of
           the rounds: the "bf16 matrix peak" the prefill is compared with
  copy     torch's copy of a 512 MB tensor (read + write bytes / s), best of the rounds
  read     torch's sum of a 640 MB fp32 tensor (bytes read / s), best of the rounds: what a kernel
           that only reads the KV cache can hope for (a bf16 sum is slower: it converts every value)

%peak: the median kernel against the best round's peak; %rpeak: the median over rounds of the
kernel against the peak of its own round (the host's load moves both within minutes).

Every ISA level this CPU runs (``asyncengine.kernels.cpu.isa``) is switched within each round;
wall time (the kernel runs on the OpenMP threads), median and min-max of the rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from single_stream import cpu_info  # noqa: E402


def wall_s(f, reps: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps


def matmul_peak(reps: int) -> float:
    a, b = torch.randn(2048, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
    return 2 * 2048 ** 3 / wall_s(lambda: torch.matmul(a, b), reps) / 1e9


def copy_peak(reps: int) -> float:
    src = torch.ones(256 * 1024 * 1024 // 2, dtype=torch.bfloat16)  # 256 MB read, 256 MB written
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / wall_s(lambda: dst.copy_(src), reps) / 1e9


def read_peak(reps: int) -> float:
    src = torch.ones(640 * 1024 * 1024 // 4)
    return src.numel() * 4 / wall_s(lambda: src.sum(), reps) / 1e9


def case(nseq: int, qlen: int, ctx: int, hq: int, hk: int, d: int, bs: int = 16, layers: int = 1,
         inorder: bool = False):
    """The call (over ``layers`` layers' caches, allocated as the engine does), its causal flops and
    its K/V bytes."""
    from asyncengine.attention.kv_cache import kv_cache_zeros
    from asyncengine.kernels.cpu import attention as A

    per = -(-(ctx + qlen) // bs)
    caches = []
    for _ in range(2 * layers):
        c = kv_cache_zeros((hk, nseq * per, bs, d), torch.bfloat16, torch.device("cpu"))
        c.copy_(torch.randn(c.shape))
        caches.append(c)
    perm = list(range(nseq * per)) if inorder else torch.randperm(nseq * per).tolist()
    batch = A.PagedBatch.build([(s * qlen, qlen, ctx, perm[s * per:(s + 1) * per]) for s in range(nseq)], bs)
    q = torch.randn(nseq * qlen, hq, d).bfloat16()
    out = torch.empty_like(q)
    visible = nseq * sum(ctx + i + 1 for i in range(qlen))  # (query row, key) pairs per head
    flops = 4 * d * hq * visible * layers
    kv_bytes = nseq * (ctx + qlen) * hk * d * 2 * 2 * layers

    def run():
        for i in range(layers):
            A.paged_attention(q, caches[2 * i], caches[2 * i + 1], batch, d ** -0.5, out)
    return run, flops, kv_bytes


CASES = {
    "prefill_d64": dict(nseq=1, qlen=512, ctx=0, hq=16, hk=4, d=64),
    "prefill_d128": dict(nseq=1, qlen=512, ctx=0, hq=32, hk=8, d=128),
    "decode_d64": dict(nseq=256, qlen=1, ctx=1023, hq=16, hk=4, d=64),
    "decode_d128": dict(nseq=256, qlen=1, ctx=1023, hq=32, hk=8, d=128),
    # the offline workload's decode: bench-model heads (GQA 2), 200 sequences x 400 keys, 8 layers
    "decode_bench8": dict(nseq=200, qlen=1, ctx=399, hq=8, hk=4, d=64, layers=8),
    "decode_bench8_inorder": dict(nseq=200, qlen=1, ctx=399, hq=8, hk=4, d=64, layers=8, inorder=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--levels", default="", help="comma-separated ISA levels (default: all this CPU runs)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from asyncengine.kernels.cpu import isa

    levels = args.levels.split(",") if args.levels else list(isa.ISAS[:isa.ISAS.index(isa.cpu_isa()) + 1])
    built = {name: case(**CASES[name]) for name in args.cases.split(",")}
    times: dict[str, list[float]] = {}
    peaks: dict[str, list[float]] = {"matmul_gflops": [], "copy_gbs": [], "read_gbs": []}
    for _ in range(args.rounds):
        peaks["matmul_gflops"].append(matmul_peak(5))
        peaks["copy_gbs"].append(copy_peak(3))
        peaks["read_gbs"].append(read_peak(3))
        for level in levels:
            isa.set_isa(level)
            for name, (f, flops, _) in built.items():
                reps = max(1, min(20, int(2e9 / flops)))  # ~1 s or less per case at 2 GFLOP/s
                times.setdefault(f"{name}/{level}", []).append(wall_s(f, reps))
        isa.set_isa("auto")
    peak, copy, read = max(peaks["matmul_gflops"]), max(peaks["copy_gbs"]), max(peaks["read_gbs"])
    rows = []
    for key, ts in times.items():
        name, level = key.split("/")
        _, flops, kv = built[name]
        med = statistics.median(ts)
        # the same round's peak: on a shared host the best-of-rounds peak and a median kernel time
        # may come from different spells of the neighbours' load
        paired = statistics.median(flops / t / 1e9 / p for t, p in zip(ts, peaks["matmul_gflops"]))
        rows.append(dict(case=name, isa=level, ms=round(med * 1e3, 3), ms_min=round(min(ts) * 1e3, 3),
                         ms_max=round(max(ts) * 1e3, 3), gflops=round(flops / med / 1e9, 1),
                         gbs=round(kv / med / 1e9, 2), pct_matmul_peak=round(100 * flops / med / 1e9 / peak, 1),
                         pct_round_peak=round(100 * paired, 1),
                         pct_copy=round(100 * kv / med / 1e9 / copy, 1),
                         pct_read=round(100 * kv / med / 1e9 / read, 1)))
    result = dict(cpu=cpu_info(), threads=args.threads, rounds=args.rounds, matmul_peak_gflops=round(peak, 1),
                  copy_gbs=round(copy, 2), read_gbs=round(read, 2), rows=rows)
    print(f"{result['cpu']}, {args.threads} threads: bf16 matmul peak {peak:.0f} GFLOP/s, copy {copy:.1f} GB/s, "
          f"read {read:.1f} GB/s")
    print(f"{'case':22} {'isa':12} {'ms (min-max)':>22} {'GFLOP/s':>8} {'GB/s':>7} {'%peak':>6} {'%rpeak':>6} "
          f"{'%copy':>6} {'%read':>6}")
    for r in rows:
        span = f"{r['ms']} ({r['ms_min']}-{r['ms_max']})"
        print(f"{r['case']:22} {r['isa']:12} {span:>22} {r['gflops']:>8} {r['gbs']:>7} {r['pct_matmul_peak']:>6} "
              f"{r['pct_round_peak']:>6} {r['pct_copy']:>6} {r['pct_read']:>6}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
