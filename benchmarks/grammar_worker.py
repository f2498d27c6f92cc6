#!/usr/bin/env python
"""What a server's grammar compiles cost (structured/compile_service.py, compile_worker.py).

1. first vs second: ``--rounds`` fresh ``asyncengine serve`` processes; on each, right after
   /health answers, two structured chat requests with distinct schemas (each one compiles: no
   cache hit) and the wall time of each; medians with the spread.
2. memory: ``--schemas`` distinct schemas (a 600-value enum each, as in issue 35's measurement)
   through one fresh server, ``--concurrency`` clients, ``max_tokens`` 1; the resident memory of
   the server's process tree (server + compile workers) every ``--every`` schemas.

    python benchmarks/make_model.py /tmp/tiny-model --size tiny
    python benchmarks/grammar_worker.py --model /tmp/tiny-model --rounds 3 --schemas 10000 \\
        --grammar-cache-bytes 8MiB [--out benchmarks/results/grammar_worker.json]

Prints one JSON object (also written to --out). Figures: docs/structured_outputs.md#compile-workers-measured.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import httpx
import psutil

ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "asyncengine", "serve", model, "--port", str(self.port),
                                      "--dtype", "float32", *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
        for _ in range(6000):  # until /health answers (a bounded wait)
            if self.proc.poll() is not None:
                raise SystemExit(f"asyncengine serve exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        self.client = httpx.Client(base_url=self.url, timeout=600)
        self.model = self.client.get("/v1/models").json()["data"][0]["id"]

    def rss_mb(self) -> float:
        p = psutil.Process(self.proc.pid)
        return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**20

    def structured(self, schema: dict) -> float:
        t0 = time.perf_counter()
        r = self.client.post("/v1/chat/completions", json={
            "model": self.model, "max_tokens": 1, "messages": [{"role": "user", "content": "Pick one."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
        r.raise_for_status()
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def enum_schema(i: int, values: int = 600) -> dict:
    return {"enum": [f"s{i}-v{j}" for j in range(values)]}


def first_second(model: str, extra: list[str], rounds: int) -> dict:
    firsts, seconds = [], []
    for r in range(rounds):
        s = Server(model, extra)
        try:
            firsts.append(s.structured({"type": "object", "properties": {"a": {"type": "integer"}},
                                        "required": ["a"], "title": f"first{r}"}))
            seconds.append(s.structured({"type": "object", "properties": {"b": {"type": "string", "maxLength": 8}},
                                         "required": ["b"], "title": f"second{r}"}))
        finally:
            s.stop()

    def summary(xs):
        return {"median_s": round(statistics.median(xs), 3), "min_s": round(min(xs), 3), "max_s": round(max(xs), 3)}

    return {"first": summary(firsts), "second": summary(seconds),
            "first_minus_second_s": [round(a - b, 3) for a, b in zip(firsts, seconds)]}


def memory(model: str, extra: list[str], schemas: int, every: int, concurrency: int) -> list[dict]:
    s = Server(model, extra)
    points = [{"schemas": 0, "rss_mb": round(s.rss_mb(), 1)}]
    try:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            for start in range(0, schemas, every):
                list(pool.map(lambda i: s.structured(enum_schema(i)), range(start, min(start + every, schemas))))
                points.append({"schemas": min(start + every, schemas), "rss_mb": round(s.rss_mb(), 1)})
                print(json.dumps(points[-1]), file=sys.stderr, flush=True)
    finally:
        s.stop()
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--schemas", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--grammar-cache-bytes", default="8MiB")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    extra = ["--grammar-cache-bytes", a.grammar_cache_bytes, "--max-num-seqs", "8"]
    out = {"cpu": cpu_name(), "cores": os.cpu_count(), "load_avg": os.getloadavg(), "model": a.model,
           "grammar_cache_bytes": a.grammar_cache_bytes}
    if a.rounds:
        out["first_vs_second"] = first_second(a.model, extra, a.rounds)
        print(json.dumps(out["first_vs_second"]), file=sys.stderr, flush=True)
    if a.schemas:
        out["memory"] = memory(a.model, extra, a.schemas, a.every, a.concurrency)
    out["load_avg_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
