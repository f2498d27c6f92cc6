#!/usr/bin/env python
"""How contiguous the engine's KV blocks are where the attention kernel reads them.

    python benchmarks/block_layout.py --model <bench model> [--workload offline] [--out result.json]

Why: the decode kernel reads each sequence's K/V one (block, KV head) slab at a time, 2 KiB at
blocks of 16 and head dim 64. Scattered slabs read at about two thirds the rate of slabs in order
(``attention_kernels.py``: ``decode_bench8`` shuffled against ``decode_bench8_inorder``), so what
the kernel can reach in the engine depends on how the block pool hands blocks out. This runs a
workload through ``LLM.generate`` (bf16, greedy, as ``throughput.py``) and records every attention
call's block tables: the share of consecutive table entries that are consecutive block ids, over
all calls and over the calls with at least ``--big`` sequences (the decode-heavy steps that
dominate the kernel's time).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import generate_greedy, model_vocab_size  # noqa: E402
from workloads import WORKLOADS, make_workload  # noqa: E402


def adjacency(tables: list[list[int]]) -> tuple[int, int]:
    """(pairs of consecutive entries that are consecutive ids, all pairs) over the tables."""
    adj = pairs = 0
    for t in tables:
        for a, b in zip(t, t[1:]):
            pairs += 1
            adj += b == a + 1
    return adj, pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", default="offline", choices=sorted(WORKLOADS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--big", type=int, default=150, help="sequences for a call to count as decode-heavy")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from asyncengine import LLM
    from asyncengine.kernels.cpu import attention as A

    calls: list[tuple[int, int, int]] = []  # (sequences, adjacent pairs, pairs)
    build = A.PagedBatch.build.__func__

    def recording_build(cls, seqs, block_size):
        seqs = list(seqs)
        tables = [list(blocks[:-(-(ctx + n) // block_size)]) for _, n, ctx, blocks in seqs]
        calls.append((len(seqs), *adjacency(tables)))
        return build(cls, seqs, block_size)

    reqs = make_workload(args.workload, model_vocab_size(args.model))
    opts = {"block_size": args.block_size} if args.block_size else {}
    llm = LLM(args.model, dtype=args.dtype, **opts)
    A.PagedBatch.build = classmethod(recording_build)
    try:
        generate_greedy(llm, reqs)
    finally:
        A.PagedBatch.build = classmethod(build)

    def share(rows):
        adj, pairs = sum(r[1] for r in rows), sum(r[2] for r in rows)
        return round(adj / pairs, 3) if pairs else None

    big = [c for c in calls if c[0] >= args.big]
    result = {"model": args.model, "workload": args.workload, "block_size": llm.config.block_size,
              "calls": len(calls), "adjacent_share": share(calls), "decode_heavy_calls": len(big),
              f"adjacent_share_{args.big}plus_sequences": share(big)}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
