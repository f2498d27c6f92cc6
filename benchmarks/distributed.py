#!/usr/bin/env python
"""Offline throughput of one model under the executors, side by side in one run:

    TP=1  uni  2 threads         one engine core, one worker thread using both cores
    TP=1  uni  1 thread          the same on one core (a reference on a shared, busy machine)
    TP=2  mp   1 thread per rank one engine core, two tensor-parallel worker processes
    PP=2  mp   1 thread per rank one engine core, two pipeline stages (half the layers each), two
                                 disjoint batches in flight
    DP=2  uni  1 thread each     two engine-core processes, each with its own KV cache

For every rank (a TP rank, a pipeline stage, a DP core's worker) the idle fraction of the timed
window is reported: 1 - (time in steps - time a stage waited for the previous one) / wall time.
For pipeline stages that is the bubble.

and then the step transport's cost (benchmarks/tp_transport.py: the ``mp`` executor's pipe with
msgspec, two ranks, no model; µs per step at 1 and 256 decode requests):

    python benchmarks/make_model.py models/llama-bench --size bench
    python benchmarks/distributed.py --model models/llama-bench --workload offline \
        --out /tmp/distributed.json          # --limit N: only the first N requests (a smoke run)

Every configuration gets the same token-id requests (benchmarks/workloads.py), greedy, EOS
ignored, all submitted at once through AsyncLLMEngine; only generation is timed (after a warm-up).
Configurations run one after the other in this process (the TP and DP ones in their own worker /
engine-core processes), and the load average before and after each is recorded. The end of the
output is a Markdown table for docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(__file__))

from workloads import make_workload  # noqa: E402

CONFIGS = {
    "tp1-2threads": dict(tensor_parallel_size=1, num_threads=2),
    "tp1-1thread": dict(tensor_parallel_size=1, num_threads=1),
    "tp2-mp-1thread": dict(tensor_parallel_size=2, distributed_executor_backend="mp", num_threads=1),
    "pp2-mp-1thread": dict(pipeline_parallel_size=2, distributed_executor_backend="mp", num_threads=1),
    "dp2-1thread": dict(data_parallel_size=2, num_threads=1),
}


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


async def run_config(name: str, args, reqs) -> dict:
    from asyncengine import AsyncLLMEngine, EngineConfig, SamplingParams

    opts = dict(CONFIGS[name])
    cfg = EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, freeze_gc_after_load=False, **opts)
    t0 = time.perf_counter()
    eng = AsyncLLMEngine(cfg)
    startup = time.perf_counter() - t0
    async with eng:
        async def go(batch, tag):
            return await asyncio.gather(*(
                eng.complete({"prompt_token_ids": ids}, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                             request_id=f"{tag}{i}") for i, (ids, n) in enumerate(batch)))
        await go([(list(range(3, 3 + 64 + 8 * i)), 8) for i in range(8)], "warm")
        load0 = os.getloadavg()[0]
        busy0 = rank_busy(eng)
        t0 = time.perf_counter()
        outs = await go(reqs, "r")
        elapsed = time.perf_counter() - t0
        busy1 = rank_busy(eng)
        load1 = os.getloadavg()[0]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(n for _, n in reqs)
    return {"config": name, **opts, "startup_s": round(startup, 1), "elapsed_s": round(elapsed, 2),
            "output_tok_s": round(out_tokens / elapsed, 1),
            "total_tok_s": round((out_tokens + sum(len(p) for p, _ in reqs)) / elapsed, 1),
            "load_before": round(load0, 2), "load_after": round(load1, 2),
            "idle_fraction": {k: round(max(0.0, 1 - (busy1[k] - busy0[k]) / elapsed), 3) for k in busy1},
            "tokens": [o.outputs[0].token_ids for o in outs]}


def rank_busy(eng) -> dict[str, float]:
    """Seconds each rank spent computing so far: its time in steps less its waits for the previous
    pipeline stage. In-process core: every rank's runner; DP cores: each core's (rank 0) busy time."""
    if eng.core is None:
        for _ in range(100):  # the cores' stats arrive with their outputs
            cores = eng.stats().get("cores", [])
            if cores and all("executor_busy_s" in c for c in cores):
                break
            time.sleep(0.05)
        return {f"core{i}": c.get("executor_busy_s", 0.0) for i, c in enumerate(cores)}
    out = {}
    for r in eng.core.collective_rpc("runner_stats"):
        key = f"stage{r.get('pp_rank', 0)}-tp{r.get('tp_rank', r['rank'])}"
        out[key] = r["execute_time_s"] - r.get("recv_wait_s", 0.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", default="offline")
    ap.add_argument("--limit", type=int, default=0, help="only the first N requests")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--transport-steps", type=int, default=2000, help="0: skip the transport measurement")
    ap.add_argument("--rounds", type=int, default=1, help="run the configurations this many times, interleaved "
                                                            "(A, B, C, A, B, C, ...); medians are reported")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    reqs = make_workload(args.workload, vocab)
    if args.limit:
        reqs = reqs[:args.limit]
    reqs = [(list(r[0]), r[1]) if isinstance(r, tuple) else (list(r.prompt_token_ids), r.max_tokens) for r in reqs]
    res = {"model": os.path.basename(os.path.normpath(args.model)), "workload": args.workload,
           "num_requests": len(reqs), "dtype": args.dtype, "cpu": cpu_model(), "cpus": os.cpu_count(),
           "command": " ".join(sys.argv), "runs": []}
    for rnd in range(args.rounds):
        for name in args.configs.split(","):
            r = asyncio.run(run_config(name, args, reqs))
            r["round"] = rnd
            print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
            res["runs"].append(r)
    base = res["runs"][0]["tokens"]
    for r in res["runs"]:
        r["same_tokens_as_first"] = sum(a == b for a, b in zip(r.pop("tokens"), base))
    if args.transport_steps:
        from tp_transport import run as transport

        res["transport_us_per_step"] = {f"B={b}": round(transport("pipe", "msgspec", 2, b, args.transport_steps), 1)
                                        for b in (1, 256)}
    print(json.dumps(res, indent=1))
    print(markdown(res))
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


def markdown(res: dict) -> str:
    """One row per configuration: medians over the rounds (min-max for output tok/s)."""
    from statistics import median

    rows = ["| configuration | output tok/s, median (min-max) | total tok/s | idle fraction per rank (median) "
            "| load before/after | same tokens |", "| --- | --- | --- | --- | --- | --- |"]
    names = list(dict.fromkeys(r["config"] for r in res["runs"]))
    for name in names:
        runs = [r for r in res["runs"] if r["config"] == name]
        out = [r["output_tok_s"] for r in runs]
        idle = ", ".join(f"{k} {median(r['idle_fraction'][k] for r in runs):.2f}" for k in runs[0]["idle_fraction"])
        loads = f"{median(r['load_before'] for r in runs):.1f} / {median(r['load_after'] for r in runs):.1f}"
        same = min(r["same_tokens_as_first"] for r in runs)
        rows.append(f"| {name} | {median(out):.1f} ({min(out):.1f}-{max(out):.1f}) | "
                    f"{median(r['total_tok_s'] for r in runs):.1f} | {idle} | {loads} | {same}/{res['num_requests']} |")
    t = res.get("transport_us_per_step")
    if t:
        rows += ["", "| transport (mp: pipe + msgspec, 2 ranks) | B=1 µs/step | B=256 µs/step |", "| --- | --- | --- |",
                 f"| measured | {t['B=1']} | {t['B=256']} |"]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
