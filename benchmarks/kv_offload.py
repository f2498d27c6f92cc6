#!/usr/bin/env python
"""KV offload (docs/kv_connector.md): the disk tier after a restart, and the host tier under a
device cache too small for the conversations, each against no connector in interleaved rounds.

    python benchmarks/kv_offload.py --out benchmarks/results/kv_offload.json

restart    A 4,000-token system prompt (random token ids) plus a 16-token question. Each round
           starts fresh engines (a restart: empty device cache) and times the first token of one
           request: ``cold`` (no connector) vs ``disk`` (``kv_offload_dir`` filled by an earlier
           engine, once, before the rounds). The files are in the page cache, as after an app
           restart on the same machine; a cold-boot read from the drive is slower.
multiturn  ``--convs`` conversations x ``--turns`` turns, all conversations of a turn submitted at
           once. Turn 1: a 256-token shared system prompt + a 128-token user message; each later turn
           resends the conversation so far plus a 32-token message; answers are 32 tokens (greedy,
           EOS ignored). The device cache holds ``--device-blocks`` blocks of 16 tokens (about two
           conversations), so prefixes are evicted between turns: ``off`` recomputes them, ``host``
           (``kv_offload_bytes`` = 1 GiB) loads them back. Reported: wall time, output tokens/s, TTFT
           median and p90, prompt tokens computed, and whether both gave the same tokens.

Rounds alternate the variants (ABAB...) on one engine configuration each; medians with min-max over
rounds. The default model is smollm2-135m-instruct (GGUF, Q4_1 weights, dtype auto).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from asyncengine import AsyncLLMEngine, EngineConfig, SamplingParams  # noqa: E402

BS = 16


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return "unknown"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def ttft_and_tokens(eng: AsyncLLMEngine, prompt: list[int], n: int, rid: str) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    first = None
    toks: list[int] = []
    async for o in eng.generate({"prompt_token_ids": prompt}, greedy(n), request_id=rid):
        if first is None and o.token_ids_delta:
            first = time.perf_counter() - t0
        toks.extend(o.token_ids_delta)
    return first, toks


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


# ---------------------------------------------------------------------------- restart


def restart(args, base: dict) -> dict:
    rng = random.Random(0)
    system = [rng.randrange(100, 40000) for _ in range(args.system_tokens)]
    questions = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(args.rounds + 1)]
    d = tempfile.mkdtemp(prefix="kv-offload-bench-")
    cfg = dict(base, max_model_len=args.system_tokens + 64, kv_cache_bytes=512 << 20, max_num_seqs=4)

    async def one(variant: str, q: list[int], rid: str):
        extra = {"kv_offload_dir": d} if variant == "disk" else {}
        t0 = time.perf_counter()
        async with AsyncLLMEngine(EngineConfig(**cfg, **extra)) as eng:
            load_s = time.perf_counter() - t0
            ttft, toks = await ttft_and_tokens(eng, system + q, 8, rid)
            s = eng.stats()
        return ttft, toks, load_s, s

    async def main():
        _, _, _, s = await one("disk", questions[0], "fill")  # fills the directory (flushed at shutdown)
        rows = {"cold": [], "disk": []}
        outs = {}
        for r in range(args.rounds):
            for variant in (("cold", "disk") if r % 2 == 0 else ("disk", "cold")):
                ttft, toks, load_s, s = await one(variant, questions[r + 1], f"{variant}{r}")
                rows[variant].append(ttft)
                outs.setdefault(r, {})[variant] = toks
                if variant == "disk":
                    hit = s["kv_offload_disk_hit_tokens"]
                print(f"restart round {r} {variant}: TTFT {ttft * 1000:.0f} ms (engine start {load_s:.1f} s)"
                      + (f", {hit} tokens from disk" if variant == "disk" else ""), flush=True)
        return rows, outs, hit

    try:
        rows, outs, hit = asyncio.run(main())
        disk_bytes = sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(d) for f in fs)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    cold, disk = summary(rows["cold"]), summary(rows["disk"])
    return {"system_tokens": args.system_tokens, "ttft_cold_s": cold, "ttft_disk_s": disk,
            "ratio_disk_over_cold": disk["median"] / cold["median"], "disk_hit_tokens": hit,
            "disk_bytes": disk_bytes, "same_tokens": all(o["cold"] == o["disk"] for o in outs.values())}


# ---------------------------------------------------------------------------- multi-turn


def multiturn(args, base: dict) -> dict:
    rng = random.Random(7)
    system = [rng.randrange(100, 40000) for _ in range(256)]
    first = [system + [rng.randrange(100, 40000) for _ in range(128)] for _ in range(args.convs)]
    later = [[[rng.randrange(100, 40000) for _ in range(32)] for _ in range(args.convs)] for _ in range(args.turns)]
    cfg = dict(base, max_model_len=2048, num_kv_blocks=args.device_blocks, block_size=BS, max_num_seqs=args.convs)

    async def run(variant: str) -> dict:
        extra = {"kv_offload_bytes": 1 << 30} if variant == "host" else {}
        async with AsyncLLMEngine(EngineConfig(**cfg, **extra)) as eng:
            hist = [list(p) for p in first]
            ttfts, outs = [], []
            t0 = time.perf_counter()
            for t in range(args.turns):
                got = await asyncio.gather(*(ttft_and_tokens(eng, hist[c], 32, f"c{c}t{t}") for c in range(args.convs)))
                for c, (ttft, toks) in enumerate(got):
                    ttfts.append(ttft)
                    outs.append(toks)
                    hist[c] = hist[c] + toks + later[t][c]
            wall = time.perf_counter() - t0
            s = eng.stats()
        ttfts.sort()
        return {"wall_s": wall, "output_tok_s": len(outs) * 32 / wall, "ttft_median_s": statistics.median(ttfts),
                "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))], "computed_prompt_tokens": s["num_computed_prompt_tokens"],
                "host_hit_tokens": s.get("kv_offload_host_hit_tokens", 0), "evictions": s["num_kv_evictions"],
                "preemptions": s["num_preemptions"], "outs": outs}

    rows = {"off": [], "host": []}
    for r in range(args.rounds):
        for variant in (("off", "host") if r % 2 == 0 else ("host", "off")):
            res = asyncio.run(run(variant))
            rows[variant].append(res)
            print(f"multiturn round {r} {variant}: {res['wall_s']:.1f} s, {res['output_tok_s']:.1f} tok/s, "
                  f"TTFT median {res['ttft_median_s'] * 1000:.0f} ms, {res['computed_prompt_tokens']} prompt "
                  f"tokens computed, {res['host_hit_tokens']} from host", flush=True)
    out = {"convs": args.convs, "turns": args.turns, "device_blocks": args.device_blocks, "block_size": BS}
    for v, rs in rows.items():
        out[v] = {k: summary([x[k] for x in rs]) for k in ("wall_s", "output_tok_s", "ttft_median_s", "ttft_p90_s")}
        out[v]["computed_prompt_tokens"] = rs[0]["computed_prompt_tokens"]
        out[v]["host_hit_tokens"] = rs[0]["host_hit_tokens"]
        out[v]["evictions"] = rs[0]["evictions"]
    out["same_tokens"] = all(a["outs"] == b["outs"] for a, b in zip(rows["off"], rows["host"]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workload", choices=["restart", "multiturn", "all"], default="all")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=4000)
    ap.add_argument("--convs", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--device-blocks", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = dict(model=args.model, dtype=args.dtype)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "nproc": os.cpu_count(), "model": args.model, "rounds": args.rounds,
              "command": " ".join(["python"] + sys.argv),
              "load": os.getloadavg()}
    if args.workload in ("restart", "all"):
        result["restart"] = restart(args, base)
    if args.workload in ("multiturn", "all"):
        result["multiturn"] = multiturn(args, base)
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
