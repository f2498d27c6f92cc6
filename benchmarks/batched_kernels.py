#!/usr/bin/env python
"""The batched step's CPU kernels on the bench model's shapes, per ISA level, in CPU time.

    python benchmarks/batched_kernels.py [--rounds 5] [--out result.json]

One thread (``time.thread_time``: the work a thread does, which other tenants' load disturbs
least), every ISA level this CPU runs (``asyncengine.kernels.cpu.isa``) switched within each
round, medians with min-max. Shapes: 8 query / 4 KV heads of 64, blocks of 16, bf16 and fp32:

  attn_decode    128 sequences x 400 cached keys, one query row each, blocks shuffled (the KV
                 cache, 52 MB in bf16, streams from memory); also ns per (key, kv head)
  attn_prefill   4 fresh chunks of 256 tokens (the row tiles share each block: compute-bound)
  silu_and_mul   256 rows x 1,408 (intermediate size)
  add_rms_norm   256 rows x 512
  rotary         256 tokens x 12 heads x 64
  linear         256 rows, 512 -> 2,816: F.linear against the oneDNN-packed weight

The "avx2" level runs the loops the kernels had before AVX-512 (scalar bf16 elementwise code
before them: "scalar").
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from single_stream import cpu_info  # noqa: E402


def cpu_ms(f, reps: int) -> float:
    f()
    t = time.thread_time()
    for _ in range(reps):
        f()
    return (time.thread_time() - t) / reps * 1e3


def attention_case(dtype, nseq, qlen, ctx, hq=8, hk=4, d=64, bs=16):
    from asyncengine.kernels.cpu import attention as A

    per = -(-(ctx + qlen) // bs)
    kc = torch.randn(hk, nseq * per, bs, d).to(dtype)
    vc = torch.randn_like(kc)
    perm = torch.randperm(nseq * per).tolist()
    batch = A.PagedBatch.build([(s * qlen, qlen, ctx, perm[s * per:(s + 1) * per]) for s in range(nseq)], bs)
    q = torch.randn(nseq * qlen, hq, d).to(dtype)
    out = torch.empty_like(q)
    return lambda: A.paged_attention(q, kc, vc, batch, d ** -0.5, out)


def cases(dtype):
    from asyncengine.kernels.cpu import ops

    x = torch.randn(256, 2 * 1408).to(dtype)
    h, r, w = torch.randn(256, 512).to(dtype), torch.randn(256, 512).to(dtype), torch.randn(512).to(dtype)
    qk, cos, sin = torch.randn(256, 12, 64).to(dtype), torch.randn(256, 1, 64).to(dtype), torch.randn(256, 1, 64).to(dtype)
    return {
        "attn_decode": (attention_case(dtype, 128, 1, 400), 5),
        "attn_prefill": (attention_case(dtype, 4, 256, 0), 3),
        "silu_and_mul": (lambda: ops.silu_and_mul(x), 50),
        "add_rms_norm": (lambda: ops.add_rms_norm(h, r, w, 1e-5), 100),
        "rotary": (lambda: ops.rotary(qk, cos, sin), 100),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from asyncengine.kernels.cpu import isa
    from asyncengine.layers import packed_linear

    levels = list(isa.ISAS[:isa.ISAS.index(isa.cpu_isa()) + 1])
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    work = {name: cases(dt) for name, dt in dtypes.items()}
    lin = {}
    for name, dt in dtypes.items():
        x, wt = torch.randn(256, 512).to(dt), (torch.randn(2816, 512) * 0.05).to(dt)
        packed = packed_linear.pack(wt)
        lin[name] = {"F.linear": lambda x=x, wt=wt: F.linear(x, wt),
                     "packed": lambda x=x, p=packed: packed_linear.linear(x, p, None, 2816)}
    samples: dict = {}
    loads = []
    for _ in range(a.rounds):
        loads.append(os.getloadavg()[0])
        for level in levels:
            isa.set_isa(level)
            for dname, kernels in work.items():
                for kname, (fn, reps) in kernels.items():
                    samples.setdefault(dname, {}).setdefault(kname, {}).setdefault(level, []).append(cpu_ms(fn, reps))
        isa.set_isa("auto")
        for dname, fns in lin.items():
            for variant, fn in fns.items():
                samples[dname].setdefault("linear_256x512x2816", {}).setdefault(variant, []).append(cpu_ms(fn, 10))
    result = {"command": "python benchmarks/batched_kernels.py " + " ".join(sys.argv[1:]), "cpu": cpu_info(),
              "isa_levels": levels, "threads": 1, "rounds": a.rounds, "torch": torch.__version__,
              "python": platform.python_version(), "load_avg_1m": loads, "cpu_ms": {}}
    keys_heads = 128 * 401 * 4
    for dname, kernels in samples.items():
        for kname, per in kernels.items():
            for variant, vals in per.items():
                med = statistics.median(vals)
                entry = {"median": round(med, 4), "min": round(min(vals), 4), "max": round(max(vals), 4)}
                if kname == "attn_decode":
                    entry["ns_per_key_head"] = round(med * 1e6 / keys_heads, 1)
                result["cpu_ms"].setdefault(dname, {}).setdefault(kname, {})[variant] = entry
                print(f"{dname:9s} {kname:20s} {variant:12s} {med:9.3f} ms ({min(vals):.3f}-{max(vals):.3f})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
