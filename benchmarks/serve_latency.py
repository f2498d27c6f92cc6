#!/usr/bin/env python
"""Online serving latency of the in-process AsyncLLMEngine, overlapped scheduling on vs off, in one run.

    python benchmarks/serve_latency.py --model models/llama-bench --dtype bfloat16 \
        --num-requests 100 --rates 2,4,8,inf --out /tmp/serve_latency.json

The shape of the team's online benchmark (``vllm bench serve`` in shared/bench/PEERS.md): random
token-id prompts of --input-len tokens (default 256), --output-len output tokens (default 128) with
EOS ignored, greedy, --num-requests requests (default 100) arriving as a Poisson process at each
request rate (``inf`` = all at once). No HTTP: the clients are tasks on the engine's own event loop,
so this measures the engine, not a web stack.

For every rate, the engine with ``EngineConfig(async_scheduling=True)`` ("overlap") and the one with
``False`` ("serial") run the same requests one after the other (alternating, so machine drift hits
both); each has its own KV cache, and every rate draws fresh prompts, so no run hits the prefix
cache of an earlier one. The model weights are loaded once and shared by both engines.

Per run, client side, milliseconds unless noted (vLLM's definitions):
  TTFT   arrival of the request -> its first token
  TPOT   (last token - first token) / (output tokens - 1), per request
  ITL    gap between two successive outputs of one request (a merged output counts once)
  out tok/s      output tokens / (last finish - first arrival)
  busy           executor busy fraction: ModelRunner.execute time / wall time of the run
  loop lag       a heartbeat task on the same loop sleeps 5 ms in a loop; its lateness (worst, p99)
                 is how long the app's event loop was blocked

Prints a table and writes every figure (plus per-request samples summary) as JSON to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from asyncengine import AsyncLLMEngine, EngineConfig, OutputKind, SamplingParams  # noqa: E402
from asyncengine.engine_core.core import EngineCore  # noqa: E402
from asyncengine.models.loader import load_model  # noqa: E402

HEARTBEAT_S = 0.005
MODES = {"overlap": True, "serial": False}


def pct(xs: list[float], q: float) -> float:
    """Percentile by linear interpolation (numpy's default); nan for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def make_requests(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(n)]


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Poisson process: exponential gaps of mean 1/rate; all zero for rate = inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def heartbeat(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(HEARTBEAT_S)
        lags.append(time.perf_counter() - t - HEARTBEAT_S)


async def one_request(eng: AsyncLLMEngine, prompt: list[int], params: SamplingParams, start_at: float,
                      t0: float) -> dict:
    delay = t0 + start_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter()
    times: list[float] = []
    n = 0
    async for out in eng.generate({"prompt_token_ids": prompt}, params):
        if out.token_ids_delta:
            times.append(time.perf_counter())
            n += len(out.token_ids_delta)
    return {"sent": sent, "times": times, "tokens": n}


async def run_once(eng: AsyncLLMEngine, prompts: list[list[int]], output_len: int, rate: float, seed: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, output_kind=OutputKind.DELTA)
    offsets = arrival_offsets(len(prompts), rate, seed)
    lags: list[float] = []
    stop = asyncio.Event()
    hb = asyncio.create_task(heartbeat(stop, lags))
    await asyncio.sleep(0)
    busy0 = eng.core.stats()["executor_busy_s"]
    steps0 = eng.core.stats()["num_steps"]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_request(eng, p, params, off, t0) for p, off in zip(prompts, offsets)))
    t1 = time.perf_counter()
    stop.set()
    await hb
    busy = eng.core.stats()["executor_busy_s"] - busy0
    steps = eng.core.stats()["num_steps"] - steps0
    bad = [r["tokens"] for r in results if r["tokens"] != output_len]
    if bad:
        raise RuntimeError(f"{len(bad)} requests did not produce {output_len} tokens: {bad[:5]}")
    ttft = [(r["times"][0] - r["sent"]) * 1e3 for r in results]
    tpot = [(r["times"][-1] - r["times"][0]) * 1e3 / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    itl = [(b - a) * 1e3 for r in results for a, b in zip(r["times"], r["times"][1:])]
    e2e = [(r["times"][-1] - r["sent"]) * 1e3 for r in results]
    first = min(r["sent"] for r in results)
    last = max(r["times"][-1] for r in results)
    wall = t1 - t0
    out_tokens = sum(r["tokens"] for r in results)
    return {
        "num_requests": len(results),
        "duration_s": round(last - first, 3),
        "output_tok_per_s": round(out_tokens / (last - first), 1),
        "ttft_ms": {"mean": round(sum(ttft) / len(ttft), 1), "p50": round(pct(ttft, 50), 1),
                    "p99": round(pct(ttft, 99), 1)},
        "tpot_ms": {"mean": round(sum(tpot) / len(tpot), 2), "p50": round(pct(tpot, 50), 2),
                    "p99": round(pct(tpot, 99), 2)},
        "itl_ms": {"mean": round(sum(itl) / len(itl), 2), "p50": round(pct(itl, 50), 2),
                   "p99": round(pct(itl, 99), 2)},
        "e2e_ms": {"p50": round(pct(e2e, 50), 1), "p99": round(pct(e2e, 99), 1)},
        "executor_busy_frac": round(busy / wall, 3),
        "engine_steps": steps,
        "loop_lag_ms": {"max": round(max(lags) * 1e3, 2) if lags else None,
                        "p99": round(pct(lags, 99) * 1e3, 2), "samples": len(lags)},
    }


def fmt_rate(r: float) -> str:
    return "inf" if math.isinf(r) else f"{r:g}"


def print_table(rows: list[dict]) -> None:
    head = ["rate", "mode", "out tok/s", "TTFT p50/p99", "TPOT p50/p99", "ITL p50/p99", "busy", "loop lag max/p99"]
    lines = [head]
    for r in rows:
        m = r["metrics"]
        lines.append([
            r["rate"], r["mode"], f"{m['output_tok_per_s']:.0f}",
            f"{m['ttft_ms']['p50']:.0f} / {m['ttft_ms']['p99']:.0f}",
            f"{m['tpot_ms']['p50']:.1f} / {m['tpot_ms']['p99']:.1f}",
            f"{m['itl_ms']['p50']:.1f} / {m['itl_ms']['p99']:.1f}",
            f"{m['executor_busy_frac']:.2f}",
            f"{m['loop_lag_ms']['max']:.1f} / {m['loop_lag_ms']['p99']:.1f}",
        ])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    for k, row in enumerate(lines):
        print(" | ".join(str(c).rjust(w) for c, w in zip(row, widths)))
        if k == 0:
            print("-+-".join("-" * w for w in widths))


async def amain(a: argparse.Namespace) -> dict:
    rates = [float("inf") if x.strip() in ("inf", "all") else float(x) for x in a.rates.split(",")]
    modes = [m.strip() for m in a.modes.split(",")]
    base = dict(model=a.model, dtype=a.dtype, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, num_threads=a.threads or None)
    blocks_per_req = -(-(a.input_len + a.output_len) // 16)
    base["num_kv_blocks"] = max(64, a.num_requests * blocks_per_req + 16)  # never preempts
    probe = EngineConfig(**base)
    loaded = load_model(probe)
    vocab = loaded.hf_config.vocab_size
    engines = {}
    for m in modes:
        cfg = EngineConfig(**base, async_scheduling=MODES[m])
        engines[m] = AsyncLLMEngine(cfg, core=EngineCore(cfg, loaded))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for m, eng in engines.items():  # warm up: a few prefills and decodes, prompts never reused
        warm = make_requests(4, a.input_len, vocab, seed=10_000 + len(m))
        await asyncio.gather(*(eng.complete({"prompt_token_ids": p}, params) for p in warm))
    rows = []
    for k, rate in enumerate(rates):
        prompts = make_requests(a.num_requests, a.input_len, vocab, seed=a.seed + k)
        for m in (modes if k % 2 == 0 else modes[::-1]):
            print(f"rate {fmt_rate(rate)} req/s, {m} ...", file=sys.stderr, flush=True)
            metrics = await run_once(engines[m], prompts, a.output_len, rate, seed=a.seed + 100 + k)
            rows.append({"rate": fmt_rate(rate), "mode": m, "async_scheduling": MODES[m], "metrics": metrics})
            print(f"  {json.dumps(metrics)}", file=sys.stderr, flush=True)
    for eng in engines.values():
        await eng.shutdown(drain=False)
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/llama-bench",
                    help="HF checkpoint folder (make it with benchmarks/make_model.py)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rates", default="2,4,8,inf", help="comma-separated req/s; inf = all at once")
    ap.add_argument("--modes", default="overlap,serial", help="overlap (async_scheduling=True), serial (False)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "serve_latency.json"))
    a = ap.parse_args()
    for m in a.modes.split(","):
        if m.strip() not in MODES:
            ap.error(f"unknown mode {m!r}: choose from {', '.join(MODES)}")
    if not os.path.isdir(a.model):
        ap.error(f"{a.model} is not a folder: python shared/bench/make_model.py {a.model} --size bench")
    t = time.perf_counter()
    if a.uvloop:
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            report = r.run(amain(a))
    else:
        report = asyncio.run(amain(a))
    report.update({
        "benchmark": "serve_latency",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "args": vars(a),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(),
                    "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "total_s": round(time.perf_counter() - t, 1),
    })
    print_table(report["rows"])
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {a.out} ({report['total_s']} s in all)")


if __name__ == "__main__":
    main()
