#!/usr/bin/env python
"""Disaggregated prefill/decode vs one colocated core vs DP=2, on a mixed stream of short chats and
long prompts, from Python (the same engines ``asyncengine serve`` would drive; not through HTTP).

    python benchmarks/pd_mixed.py --out benchmarks/results/pd_mixed.json

Requests arrive at ``--rate`` per second (Poisson, seed 0) for ``--seconds``: every ``--long-every``-th
is a long prompt (``--long-tokens`` random token ids, 16 output tokens), the rest short chats
(``--short-tokens`` prompt tokens, 64 output tokens), greedy, EOS ignored. ``--short-tokens`` may be
a list (``16,64,128``): each length is a workload of its own, its variants named ``VARIANT@LENGTH``
(how the hop threshold was chosen: ``pd`` vs ``pdskip`` by short-prompt length). Variants, in alternating order over rounds:
``colocated`` (one core, ``engine_core_process=True``), ``dp2`` (``data_parallel_size=2``) and
``pd`` (``PDEngine``, 1 prefill + 1 decode core), ``pdskip`` (the same, prompts under
``--skip-hop-below`` tokens straight to the decode core; default: every short prompt, no long one),
each core pinned to ``--num-threads`` (1) torch
threads. Reported per variant: TPOT p50/p90 of the short
chats (time between their tokens: what a long prefill in the same step stalls), TTFT p50 of short
and long requests, wall time, and the CPU model and load average (the host is shared); medians over
rounds with their min and max.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time

from asyncengine import AsyncLLMEngine, EngineConfig, SamplingParams


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1)))] if xs else None


async def one(eng, prompt, n, rid):
    t0 = time.perf_counter()
    stamps = []
    async for o in eng.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=n, temperature=0.0,
                                                                              ignore_eos=True), request_id=rid):
        if o.token_ids_delta:
            stamps.extend([time.perf_counter()] * len(o.token_ids_delta))
    ttft = stamps[0] - t0
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return ttft, tpot


async def run(variant: str, args, short_tokens: int) -> dict:
    base = dict(model=args.model, dtype=args.dtype, max_num_seqs=64, kv_cache_bytes=1 << 30,
                max_model_len=args.long_tokens + 64, num_threads=args.num_threads)
    if variant in ("pd", "pdskip"):
        skip = (args.skip_hop_below or args.long_tokens) if variant == "pdskip" else 0
        eng = AsyncLLMEngine.from_config(EngineConfig(**base, prefill_cores=1, decode_cores=1, pd_skip_hop_below=skip))
    elif variant == "dp2":
        eng = AsyncLLMEngine(EngineConfig(**base, data_parallel_size=2))
    else:
        eng = AsyncLLMEngine(EngineConfig(**base, engine_core_process=True))
    rng = random.Random(0)
    async with eng:
        await one(eng, [rng.randrange(100, 40000) for _ in range(32)], 4, "warm")
        tasks, kinds = [], []
        t_end = time.perf_counter() + args.seconds
        i = 0
        t0 = time.perf_counter()
        while time.perf_counter() < t_end:
            long = i % args.long_every == args.long_every - 1
            n_prompt, n_out = (args.long_tokens, 16) if long else (short_tokens, 64)
            prompt = [rng.randrange(100, 40000) for _ in range(n_prompt)]
            tasks.append(asyncio.ensure_future(one(eng, prompt, n_out, f"{variant}-{i}")))
            kinds.append("long" if long else "short")
            i += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        res = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    short = [r for r, k in zip(res, kinds) if k == "short"]
    long_ = [r for r, k in zip(res, kinds) if k == "long"]
    return {"requests": len(res), "long": len(long_), "wall_s": wall,
            "tpot_short_p50_ms": 1000 * pct([t for _, t in short if t is not None], 0.5),
            "tpot_short_p90_ms": 1000 * pct([t for _, t in short if t is not None], 0.9),
            "ttft_short_p50_s": pct([t for t, _ in short], 0.5), "ttft_long_p50_s": pct([t for t, _ in long_], 0.5)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--long-every", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--num-threads", type=int, default=1,
                    help="torch threads per core (1: a core is one CPU core; two threads that wait on each "
                         "other on a contended 2-core host make steps many times slower)")
    ap.add_argument("--variants", default="colocated,pd,pdskip,dp2")
    ap.add_argument("--short-tokens", default="32", help="short prompts' length; a comma list: one workload each")
    ap.add_argument("--skip-hop-below", type=int, default=None,
                    help="pdskip: prompts shorter than this skip the hop (default: --long-tokens)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.short_tokens.split(",")]
    named = [(v if len(lengths) == 1 else f"{v}@{n}", v, n) for n in lengths for v in args.variants.split(",")]
    rows: dict[str, list] = {name: [] for name, _, _ in named}
    load = [os.getloadavg()]
    for r in range(args.rounds):
        for name, v, n in (named if r % 2 == 0 else named[::-1]):
            res = asyncio.run(run(v, args, n))
            rows[name].append(res)
            print(name, json.dumps(res), flush=True)
            load.append(os.getloadavg())
            write(args, rows, load)  # after every run: a slow sitting that is cut short keeps what it measured
    print(json.dumps(write(args, rows, load)["median"], indent=1))
    return 0


def write(args, rows: dict, load: list) -> dict:
    summary = {v: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for v, rs in rows.items() if rs}
    spread = {v: {k: [min(x[k] for x in rs), max(x[k] for x in rs)] for k in rs[0]} for v, rs in rows.items() if rs}
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "nproc": os.cpu_count(), "command": " ".join(["python"] + sys.argv),
              "load_avg": load, "args": vars(args), "median": summary, "min_max": spread, "rounds": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main())
