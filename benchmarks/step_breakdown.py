#!/usr/bin/env python
"""Where a batched workload's model time goes, by layer part, timed on the model thread itself.

    python benchmarks/step_breakdown.py --model <bench model> [--workload offline] [--dtype bfloat16]
        [--out result.json]

Why not a sampling profiler: py-spy ``--native`` attributes a thread's native frames unevenly
(OpenMP regions, ctypes calls), and torch.profiler's hooks cost as much as the small ops they time.
Here the parts of a Llama step (``Linear.forward`` per output width, the attention backend's
``forward``, the norms, the activation, rotary, the runner's sampling) are wrapped with wall clocks
for one ``LLM.generate`` of the workload (bf16, greedy, EOS ignored, as ``throughput.py``). The
model thread runs them one after another, so the parts of ``_forward`` add up to it (what it
holds beyond them is the model's own Python and the ops not wrapped: embedding, rotary lookup);
the LM head (``linear -> vocabulary``) is inside the sampling part. The native
step (block-quantized weights) bypasses these modules: use a dense checkpoint.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from single_stream import cpu_info  # noqa: E402
from throughput import generate_greedy, model_vocab_size  # noqa: E402
from workloads import WORKLOADS, make_workload  # noqa: E402


def timed(owner, name: str, key, seconds: dict, calls: collections.Counter) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to ``seconds[key(args)]``."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            k = key(args)
            seconds[k] += time.perf_counter() - t0
            calls[k] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", default="offline", choices=sorted(WORKLOADS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from asyncengine import LLM
    from asyncengine.attention.cpu_backend import CpuBackend
    from asyncengine.layers.activation import ActAndMul
    from asyncengine.layers.linear import Linear
    from asyncengine.layers.norm import RMSNorm
    from asyncengine.models import llama
    from asyncengine.worker.model_runner import ModelRunner

    reqs = make_workload(args.workload, model_vocab_size(args.model))
    llm = LLM(args.model, dtype=args.dtype)
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    timed(Linear, "forward", lambda a: f"linear -> {a[0].out_features}", seconds, calls)
    timed(CpuBackend, "forward", lambda a: "attention (write + attend)", seconds, calls)
    timed(RMSNorm, "forward", lambda a: "rms norm", seconds, calls)
    timed(ActAndMul, "__call__", lambda a: "activation x up", seconds, calls)
    timed(llama, "apply_rotary", lambda a: "rotary", seconds, calls)
    timed(ModelRunner, "_sample", lambda a: "sample (LM head included)", seconds, calls)
    timed(ModelRunner, "_forward", lambda a: "forward (all layers)", seconds, calls)
    timed(ModelRunner, "_execute", lambda a: "step (runner)", seconds, calls)
    t0 = time.perf_counter()
    generate_greedy(llm, reqs)
    elapsed = time.perf_counter() - t0
    step = seconds["step (runner)"]
    parts = [{"part": k, "s": round(v, 3), "share_of_steps": round(v / step, 3), "calls": calls[k]}
             for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])]
    result = {"cpu": cpu_info(), "model": args.model, "workload": args.workload, "dtype": args.dtype,
              "elapsed_s": round(elapsed, 3), "parts": parts}
    for p in parts:
        print(f"{p['part']:28} {p['s']:8.3f} s {100 * p['share_of_steps']:5.1f}%  {p['calls']} calls")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
