#!/usr/bin/env python
"""Hostile structured outputs against a live server (the real app under uvicorn, on 127.0.0.1).

1. latency: a normal chat request (32 tokens, unconstrained) alone, then while hostile clients
   keep sending issue 27's schemas (each one made distinct, so that none is refused from the
   failed-grammar memory: every one is checked, and the ones that pass compile until the budget
   kills them); medians with their spread, and the ratio.
2. memory: ``--schemas`` distinct ~15 KB schemas through the server, one after another; the
   resident memory of the server's process tree and the compiled-grammar cache's own byte count,
   every 250 schemas.

    python benchmarks/make_model.py /tmp/bench-model      # a 32k-vocabulary random-weight Llama
    python benchmarks/hostile_grammar.py --model /tmp/bench-model [--modes in-process,core-process,dp2]
        [--schemas 2000] [--grammar-cache-bytes 32MiB] [--out benchmarks/results/hostile_grammar.json]

Prints one JSON object (also written to --out). Figures and what they mean:
docs/structured_outputs.md#hostile-requests-measured.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import socket
import statistics
import subprocess
import threading
import time

import openai
import psutil
import uvicorn

from asyncengine import AsyncLLMEngine, EngineConfig
from asyncengine.cli.args import parse_size
from asyncengine.integrations.openai_server import build_app
from asyncengine.config.grammar_limits import GrammarLimits

MODEL = "bench"


def hostile_schemas(i: int) -> list[dict]:
    """Issue 27's patterns, made distinct by ``i`` (a title changes the cache key, not the cost)."""
    t = f"h{i}"
    deep: dict = {"type": "integer"}
    for _ in range(20):
        deep = {"type": "object", "properties": {"x": deep}, "required": ["x"]}
    return [
        {"title": t, "type": "string", "pattern": "[a-z]{1,20000}"},  # minutes of compile: the budget kills it
        {"title": t, "type": "string", "pattern": "[a-z]{1,5000}"},  # refused upfront at the default limits
        {"title": t, "enum": [f"v{j}" for j in range(10_000)]},
        {"title": t, "type": "string", "pattern": "|".join(f"w{j}" for j in range(10_000))},
        dict(deep, title=t),
        {"title": t, "$ref": "https://example.com/schema.json"},
        {"title": t, "type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"],
         "additionalProperties": False},
    ]


def distinct_schema(i: int) -> dict:
    """~15 KB, different for every i."""
    props = {f"field_{i}_{k}": {"type": "string", "maxLength": 8 + k % 5,
                                "description": f"property {k} of schema {i} " + "x" * 160} for k in range(60)}
    return {"type": "object", "properties": props, "required": [f"field_{i}_0"]}


class Server:
    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.app = build_app(engine, served_model_name=MODEL, own_engine=True)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="error", lifespan="on",
                                                    ws_max_size=engine.limits.max_request_bytes))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(60)


def rss_tree_mb() -> float:
    me = psutil.Process()
    total = me.memory_info().rss
    for c in me.children(recursive=True):
        try:
            total += c.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def normal(c: openai.OpenAI) -> float:
    t0 = time.perf_counter()
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                                  max_tokens=32, temperature=0.0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 32
    return time.perf_counter() - t0


def spread(xs: list[float]) -> dict:
    return {"median_s": round(statistics.median(xs), 3), "min_s": round(min(xs), 3), "max_s": round(max(xs), 3),
            "n": len(xs)}


def latency(c: openai.OpenAI, runs: int, hostile_clients: int) -> dict:
    for _ in range(2):
        normal(c)  # warm
    alone = [normal(c) for _ in range(runs)]
    stop = threading.Event()
    outcomes: dict[str, int] = {}
    counter = iter(range(10**9))
    lock = threading.Lock()

    def attack() -> None:
        with openai.OpenAI(base_url=c.base_url, api_key="x", max_retries=0, timeout=120) as h:
            while not stop.is_set():
                for s in hostile_schemas(next(counter)):
                    if stop.is_set():
                        return
                    try:
                        h.chat.completions.create(
                            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8,
                            response_format={"type": "json_schema", "json_schema": {"name": "h", "schema": s}})
                        key = "answered"
                    except openai.BadRequestError as e:
                        m = re.search(r"(max_\w+)=|(not local)|(never be satisfied)", str(e))
                        key = "400 " + (next(g for g in m.groups() if g) if m else "other")
                    with lock:
                        outcomes[key] = outcomes.get(key, 0) + 1

    threads = [threading.Thread(target=attack, daemon=True) for _ in range(hostile_clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    alongside = [normal(c) for _ in range(runs)]
    stop.set()
    for t in threads:
        t.join(180)
    a, b = statistics.median(alone), statistics.median(alongside)
    return {"alone": spread(alone), "alongside_hostile": spread(alongside), "ratio_of_medians": round(b / a, 2),
            "hostile_clients": hostile_clients, "hostile_outcomes": outcomes}


def memory(c: openai.OpenAI, engine: AsyncLLMEngine, n: int) -> dict:
    from asyncengine.structured.compile_service import _services

    rows = []
    base = rss_tree_mb()
    for i in range(n):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "s", "schema": distinct_schema(i)}})
        if (i + 1) % 250 == 0 or i + 1 == n:
            cache = [s.compiler.cache.stats() for s in _services.values()]
            rows.append({"schemas": i + 1, "rss_tree_mb": round(rss_tree_mb(), 1),
                         "front_end_cache_mb": round(sum(x["bytes"] for x in cache) / 2**20, 1),
                         "evictions": sum(x["evictions"] for x in cache)})
            print(json.dumps(rows[-1]), flush=True)
    return {"rss_tree_mb_before": round(base, 1), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--modes", default="in-process,core-process,dp2")
    ap.add_argument("--schemas", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--hostile-clients", type=int, default=2)
    ap.add_argument("--grammar-cache-bytes", type=parse_size, default=32 << 20)
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/hostile_grammar.json")
    a = ap.parse_args()
    limits = GrammarLimits(grammar_cache_bytes=a.grammar_cache_bytes, max_regex_repetition=50_000)
    result = {"cpu": subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Model name:")[1]
              .splitlines()[0].strip(), "cores": psutil.cpu_count(), "python": platform.python_version(),
              "model": a.model, "limits": {f: getattr(limits, f) for f in limits.__struct_fields__},
              "note": "shared 2-core host, other engineers' test runs going on: noisy", "modes": {}}
    for mode in a.modes.split(","):
        kw = {"in-process": {}, "core-process": {"engine_core_process": True},
              "dp2": {"data_parallel_size": 2}}[mode]
        engine = AsyncLLMEngine(EngineConfig(model=a.model, dtype="float32", max_model_len=1024,
                                             kv_cache_bytes=256 << 20, grammar_limits=limits, **kw))
        with Server(engine) as s, openai.OpenAI(base_url=s.url, api_key="x", max_retries=0, timeout=120) as c:
            r = {} if a.skip_latency else {"latency": latency(c, a.runs, a.hostile_clients)}
            print(mode, json.dumps(r), flush=True)
            if mode == "in-process" and a.schemas:
                r["memory"] = memory(c, engine, a.schemas)
            result["modes"][mode] = r
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
