#!/usr/bin/env python
"""The cpu backend's attention kernel against the torch backend's prefill path, per chunk length:
the measurement behind ``attention/cpu_backend.KERNEL_MAX_QUERY_LEN``.

    python benchmarks/attention_crossover.py [--threads 1] [--contexts 0,256,1024]
        [--lengths 1,4,16,128,512] [--heads 9 --kv-heads 3 --head-dim 64 --block-size 16]

One sequence per call, its blocks shuffled in a cache of random K/V, fp32. Prints the CPU time per
call (``time.thread_time``: robust to other processes' load; with --threads > 1 use the wall
clock, --wall) of each path and their ratio.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contexts", default="0,256,1024")
    ap.add_argument("--lengths", default="1,4,16,128,512")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--wall", action="store_true", help="time with the wall clock, not CPU time")
    args = ap.parse_args()

    import torch

    from asyncengine.kernels.cpu import attention as A
    from asyncengine.layers.attention import PrefillChunk, TorchPagedAttention

    torch.set_num_threads(args.threads)
    assert A.available(), "the CPU kernels did not build"
    hq, hk, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    lengths = [int(x) for x in args.lengths.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    nb = -(-(max(contexts) + max(lengths)) // bs) + 1
    kc, vc = torch.randn(hk, nb, bs, d), torch.randn(hk, nb, bs, d)
    impl = TorchPagedAttention(hq, hk, d, d ** -0.5)
    clock = time.perf_counter if args.wall else time.thread_time

    def timed(fn, iters):
        fn()
        t = clock()
        for _ in range(iters):
            fn()
        return (clock() - t) / iters * 1e6

    print(f"{'context':>8} {'tokens':>7} {'kernel us':>10} {'torch us':>10} {'torch/kernel':>13}")
    for ctx in contexts:
        for n in lengths:
            blocks = random.sample(range(nb), -(-(ctx + n) // bs))
            q, k, v = torch.randn(n, hq, d), torch.randn(n, hk, d), torch.randn(n, hk, d)
            batch = A.PagedBatch.build([(0, n, ctx, blocks)], bs)
            out = torch.empty(n, hq, d)
            chunk = PrefillChunk(0, n, ctx, torch.tensor(blocks))
            iters = max(3, 2000 // (n + ctx // 8))
            tk = timed(lambda: A.paged_attention(q, kc, vc, batch, d ** -0.5, out), iters)
            tt = timed(lambda: impl._prefill(q, k, v, kc, vc, chunk), iters)
            print(f"{ctx:8d} {n:7d} {tk:10.1f} {tt:10.1f} {tt / tk:13.2f}")


if __name__ == "__main__":
    main()
