#!/usr/bin/env python
"""Batch-invariant mode vs the default, side by side: offline throughput and single-stream decode.

    python benchmarks/batch_invariance.py --model models/llama-bench [--dtype float32 bfloat16]
        [--requests 16] [--rounds 5] [--threads 1] [--out benchmarks/results/batch_invariance.json]
    python benchmarks/batch_invariance.py --kernels [--out ...]   # what costs what: the matmuls alone
    python benchmarks/batch_invariance.py --model models/llama-bench --distinct [--out ...]

Both engines (``batch_invariant`` False / True) are built once per dtype and measured in
interleaved rounds (the order alternates each round), so a noisy host's drift hits both alike:

  offline   the first ``--requests`` requests of the ``offline`` workload (benchmarks/workloads.py;
            prompts 64-512 tokens, outputs 32-256, greedy, EOS ignored) in one ``LLM.generate``
  decode    one request, a 32-token prompt, ``--decode-tokens`` tokens (its prefill included)

each as output tokens per wall second and per CPU second of the process (the steadier figure on a
shared host; with one thread it is the work the engine does).

``--kernels`` times the matmuls the mode swaps, on the bench model's shapes (hidden 512, MLP 1408,
vocabulary 32000), one thread, CPU time (process_time: less exposed to other processes' load), best
of 7 interleaved rounds: ``invariant.linear`` vs ``F.linear`` (fp32, bf16) and the Q8_0/Q4_0 ``gemm``
with fp32 activations, ``fixed_order`` vs without, at M = 1, 16, 256.

``--distinct`` is the issue's experiment: one greedy request with top-5 logprobs, 12 times, alone
and among 1-40 other requests of random lengths, under chunked-prefill budgets of 16, 64 and 2048
tokens, with its prefix cached by an earlier request or not; it counts the distinct outputs
(token ids and logprob floats) per dtype and mode.

Reports the median and the spread (min-max) of the rounds, the ratio default / invariant of the
medians (> 1: the invariant mode is slower by that factor), and the CPU it ran on.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of fn(): on a shared host the CPU time is the
    steadier measure of the work (other processes' load stretches wall time, not CPU time)."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def offline(llm, requests) -> tuple[float, float]:
    """Output tokens per wall second and per CPU second of one LLM.generate over the requests."""
    from asyncengine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in requests]
    wall, cpu = timed(lambda: llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False))
    tokens = sum(m for _, m in requests)  # greedy, EOS ignored: every request runs to max_tokens
    return tokens / wall, tokens / cpu


def decode(llm, prompt: list[int], tokens: int) -> tuple[float, float]:
    """One request: tokens per wall second and per CPU second, its prompt's prefill included."""
    from asyncengine import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    wall, cpu = timed(lambda: llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False))
    return tokens / wall, tokens / cpu


def summary(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 1), "min": round(min(xs), 1), "max": round(max(xs), 1),
            "rounds": [round(x, 1) for x in xs]}


def kernels(rounds: int = 7) -> dict:
    import torch
    import torch.nn.functional as F

    from asyncengine.kernels.cpu import invariant, quant

    torch.set_num_threads(1)
    shapes = [(512, 1024), (512, 2816), (1408, 512), (512, 32000)]  # qkv, gate_up, down, lm head (K, N)
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, k, generator=g) for k, n in shapes]
    out = {}
    variants = {}
    for dtype in (torch.float32, torch.bfloat16):
        ws = [w.to(dtype) for w in dense]
        name = str(dtype).split(".")[1]
        variants[name] = ({"default": lambda x, w: F.linear(x, w), "invariant": invariant.linear}, ws, dtype)
    for qtype in ("Q8_0", "Q4_0"):
        ws = [(quant.quantize(w, qtype), w.shape[1]) for w in dense]
        # fp32 activations: where fixed_order changes the route (int8 runs one kernel at every M)
        variants[qtype] = ({"default": lambda x, w, q=qtype: quant.gemm(x, w[0], q, w[1], activations="fp32"),
                            "invariant": lambda x, w, q=qtype: quant.gemm(x, w[0], q, w[1], activations="fp32",
                                                                          fixed_order=True)},
                           ws, torch.float32)
    for name, (fns, ws, dtype) in variants.items():
        for m in (1, 16, 256):
            xs = [torch.randn(m, k, generator=g).to(dtype) for k, _ in shapes]
            best = {v: float("inf") for v in fns}
            reps = max(1, 64 // m)
            for _ in range(rounds):
                for v, fn in fns.items():
                    t = time.process_time()
                    for _ in range(reps):
                        for x, w in zip(xs, ws):
                            fn(x, w)
                    best[v] = min(best[v], (time.process_time() - t) / reps * 1e3)
            out[f"{name} M={m}"] = {"default_ms": round(best["default"], 2), "invariant_ms": round(best["invariant"], 2),
                                    "cost_x": round(best["invariant"] / best["default"], 2)}
            print(name, m, out[f"{name} M={m}"], flush=True)
    return out


def distinct(model: str, dtype: str, invariant: bool, runs: int = 12, threads: int = 1) -> int:
    import random

    from asyncengine import LLM, SamplingParams

    rng = random.Random(0)
    target = [rng.randrange(3, 32000) for _ in range(96)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True)
    seen = set()
    engines = {b: LLM(model, dtype=dtype, batch_invariant=invariant, num_threads=threads, seed=0,
                      max_model_len=1024, max_num_batched_tokens=b) for b in (16, 64, 2048)}
    try:
        for r in range(runs):
            llm = engines[(16, 64, 2048)[r % 3]]
            if r % 4 == 1:  # the prefix cached by an earlier request
                llm.generate([{"prompt_token_ids": target[:80] + [5, 6, 7]}],
                             SamplingParams(max_tokens=1), use_tqdm=False)
            n = 0 if r == 0 else rng.randint(1, 40)
            batch = [[rng.randrange(3, 32000) for _ in range(rng.randint(8, 160))] for _ in range(n)]
            pos = rng.randint(0, n)
            batch.insert(pos, target)
            params = [sp if i == pos else SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True)
                      for i in range(len(batch))]
            out = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)[pos].outputs[0]
            seen.add((tuple(out.token_ids),
                      tuple(tuple(sorted((t, lp.logprob) for t, lp in pos_lp.items())) for pos_lp in out.logprobs)))
    finally:
        for llm in engines.values():
            llm.shutdown()
    return len(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--kernels", action="store_true", help="time the swapped matmuls alone")
    ap.add_argument("--distinct", action="store_true", help="count one request's distinct outputs over batches")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=16, help="the first N requests of the offline workload")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.kernels:
        from single_stream import cpu_info

        result = {"cpu": cpu_info(), "threads": 1, "unit": "ms of CPU per pass over the four matmuls",
                  "kernels": kernels()}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
                f.write("\n")
        return
    if not args.model:
        ap.error("--model is required (or --kernels)")
    if args.distinct:
        from single_stream import cpu_info

        result = {"cpu": cpu_info(), "model": args.model, "threads": args.threads, "runs": 12, "distinct": {}}
        for dtype in args.dtype:
            for inv in (False, True):
                n = distinct(args.model, dtype, inv, threads=args.threads)
                result["distinct"][f"{dtype} {'invariant' if inv else 'default'}"] = n
                print(dtype, "invariant" if inv else "default", "distinct outputs:", n, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
                f.write("\n")
        return

    from asyncengine import LLM
    from single_stream import cpu_info
    from workloads import make_workload

    requests = make_workload("offline")[:args.requests]
    prompt = make_workload("offline")[-1][0][:32]
    result = {"cpu": cpu_info(), "model": args.model, "threads": args.threads, "requests": args.requests,
              "output_tokens": sum(m for _, m in requests), "rounds": args.rounds,
              "decode_tokens": args.decode_tokens, "results": {}}
    for dtype in args.dtype:
        engines = {inv: LLM(args.model, dtype=dtype, batch_invariant=inv, num_threads=args.threads, seed=0,
                            max_model_len=1024) for inv in (False, True)}
        for llm in engines.values():  # warm-up: kernels built, first-step allocations done
            offline(llm, requests[:2])
        runs = {(inv, what): [] for inv in (False, True) for what in ("offline", "decode")}
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for inv in order:
                runs[(inv, "offline")].append(offline(engines[inv], requests))
                runs[(inv, "decode")].append(decode(engines[inv], prompt, args.decode_tokens))
                o, d = runs[(inv, "offline")][-1], runs[(inv, "decode")][-1]
                print(f"{dtype} round {r} {'invariant' if inv else 'default'}: offline {o[0]:.1f} tok/s "
                      f"({o[1]:.1f} per CPU s), decode {d[0]:.1f} tok/s ({d[1]:.1f} per CPU s)", flush=True)
        for llm in engines.values():
            llm.shutdown()
        res = {}
        for what in ("offline", "decode"):
            for i, clock in enumerate(("wall", "cpu")):
                d = summary([x[i] for x in runs[(False, what)]])
                v = summary([x[i] for x in runs[(True, what)]])
                res[f"{what}_{clock}"] = {"default_tok_s": d, "invariant_tok_s": v,
                                          "cost_x": round(d["median"] / v["median"], 3)}
        result["results"][dtype] = res
        print(json.dumps({dtype: res}), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
