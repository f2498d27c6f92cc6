#!/usr/bin/env python
"""Soak: thousands of mixed, partly hostile requests against ``asyncengine serve``'s app, then
check that nothing was lost, nothing leaked and the server stayed responsive.

    python benchmarks/soak.py --requests 20000 --concurrency 64 --out /tmp/soak.json

The server runs in its own process (the real app under uvicorn + uvloop, on 127.0.0.1, around a
tiny random-weight Llama made on the fly, or --model), with a heartbeat task on its event loop
that records how late each 10 ms sleep wakes up (the loop lag). The client mixes, at random:

  complete    POST /v1/completions, stream or not              -> 200 with a finish_reason
  chat        POST /v1/chat/completions, streamed              -> every event, then [DONE]
  cancel      a stream the client drops after a few events     -> (client disconnect)
  disconnect  a long non-streamed request abandoned mid-way    -> (client disconnect)
  invalid     one of many bad requests (limits, types, JSON depth, content type, host...) -> 4xx
  ws          a websocket chat, half of them cancelled by a cancel frame -> a "done" frame

A request is *lost* if it got a 5xx, a status it should not, an incomplete stream, or no answer
within the hang guard. Afterwards, from the server's public /metrics: *leaked* KV blocks = blocks
in all - free blocks once idle. RSS growth: the server's RSS at the end vs after the warm-up (the
first 10% of requests), both taken idle. Prints and writes (--out) the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

HANG_GUARD_S = 120.0
HEARTBEAT_S = 0.01
MODEL_NAME = "soak"
PROMPTS = ["The quick brown fox", "def f(x):", "Paris is the capital of", "Once upon a time", "Hello"]


# ---------------------------------------------------------------- the server (a child process)


async def _serve(args) -> None:
    import uvicorn

    from asyncengine import AsyncLLMEngine, EngineConfig
    from asyncengine.integrations.openai_server import build_app

    engine = AsyncLLMEngine(EngineConfig(model=args.model, dtype="float32", max_model_len=args.max_model_len,
                                         num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs))
    app = build_app(engine, served_model_name=MODEL_NAME, own_engine=True)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=5))
    loop = asyncio.get_running_loop()
    lags: list[float] = []

    async def heartbeat() -> None:
        while True:
            t = loop.time()
            await asyncio.sleep(HEARTBEAT_S)
            lags.append(loop.time() - t - HEARTBEAT_S)
            if len(lags) > 2_000_000:
                del lags[:1_000_000]

    hb = asyncio.create_task(heartbeat())
    reset = os.path.join(os.path.dirname(args.stats), "reset-lag")

    async def resetter() -> None:  # the client asks for a fresh lag record after its warm-up
        while True:
            await asyncio.sleep(0.2)
            if os.path.exists(reset):
                os.unlink(reset)
                lags.clear()

    rs = asyncio.create_task(resetter())
    try:
        await server.serve()
    finally:
        hb.cancel()
        rs.cancel()
        xs = sorted(lags)
        p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")
        with open(args.stats, "w") as f:
            json.dump({"lag_p99_ms": p99 * 1e3, "lag_max_ms": (xs[-1] if xs else float("nan")) * 1e3,
                       "lag_samples": len(xs)}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python benchmarks/soak.py --serve ...`` as a child; stop() returns its loop-lag figures."""

    def __init__(self, model: str, max_model_len: int = 256, num_kv_blocks: int = 256, max_num_seqs: int = 64
                 ) -> None:
        self.port = _free_port()
        self.dir = tempfile.mkdtemp(prefix="soak-")
        self.stats = os.path.join(self.dir, "stats.json")
        self.log = open(os.path.join(self.dir, "server.log"), "w+")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", "--model", model, "--port", str(self.port),
             "--stats", self.stats, "--max-model-len", str(max_model_len), "--num-kv-blocks", str(num_kv_blocks),
             "--max-num-seqs", str(max_num_seqs)], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        import httpx

        for _ in range(int(HANG_GUARD_S / 0.1)):
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.log.seek(0)
        raise RuntimeError(f"the soak server did not start:\n{self.log.read()[-3000:]}")

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def reset_lag(self) -> None:
        open(os.path.join(self.dir, "reset-lag"), "w").close()

    def stop(self) -> dict:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        try:
            with open(self.stats) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}


# ---------------------------------------------------------------- the client


def invalid_requests(port: int) -> list[tuple[str, dict | bytes, dict]]:
    """(path, body, extra headers) of requests that must be refused with a 4xx."""
    m = MODEL_NAME
    big = {"model": m, "prompt": "x" * 10_000_000}
    return [
        ("/v1/completions", {"model": m, "prompt": "hi", "temperature": 9}, {}),
        ("/v1/completions", {"model": m, "prompt": "hi", "stop": ["x" * 80_000]}, {}),
        ("/v1/completions", {"model": m, "prompt": "hi", "stop": [str(i) for i in range(50)]}, {}),
        ("/v1/completions", {"model": m, "prompt": "hi", "n": 100_000}, {}),
        ("/v1/completions", {"model": m, "prompt": "hi", "logprobs": 99}, {}),
        ("/v1/completions", {"model": m, "prompt": "hi", "stop_token_ids": [5] * 100_000}, {}),
        ("/v1/completions", {"model": m, "prompt": [5, 10**9]}, {}),
        ("/v1/completions", {"model": m, "prompt": "x" * 200_000}, {}),
        ("/v1/completions", {"model": m, "prompt": "hi", "max_tokens": 10**6}, {}),
        ("/v1/completions", {"model": "gpt-4o", "prompt": "hi"}, {}),
        ("/v1/completions", b'{"model": "soak", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}),
        ("/v1/completions", b"{not json", {}),
        ("/v1/completions", json.dumps(big).encode(), {}),
        ("/v1/completions", {"model": m, "prompt": "hi"}, {"content-type": "text/plain"}),
        ("/v1/completions", {"model": m, "prompt": "hi"}, {"origin": "http://evil.example"}),
        ("/v1/models", None, {"host": "evil.example"}),
        ("/v1/chat/completions", {"model": m, "messages": [{"content": "no role"}]}, {}),
        ("/v1/chat/completions", {"model": m, "messages": [{"role": "user"}]}, {}),
        ("/v1/chat/completions", {"model": m, "messages": []}, {}),
        ("/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "hi"}],
                                  "logit_bias": {"5": 1e999}}, {}),
    ]


class Soak:
    def __init__(self, base_url: str, seed: int = 0, guard_s: float = HANG_GUARD_S) -> None:
        self.base = base_url
        self.port = int(base_url.rsplit(":", 1)[1])
        self.rng = random.Random(seed)
        self.guard_s = guard_s
        self.invalid = invalid_requests(self.port)
        self.counts: dict[str, int] = {}
        self.lost: list[str] = []

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    async def one(self, client, i: int) -> None:
        kind = self.rng.choices(["complete", "chat", "cancel", "disconnect", "invalid", "ws"],
                                weights=[30, 20, 15, 10, 15, 10])[0]
        try:
            outcome = await asyncio.wait_for(getattr(self, "_" + kind)(client, i), self.guard_s)
        except asyncio.TimeoutError:
            outcome = "lost: no answer within the hang guard"
        except Exception as e:  # noqa: BLE001 - a soak counts every surprise as a loss
            outcome = f"lost: {type(e).__name__}: {e}"
        if outcome.startswith("lost"):
            self.lost.append(f"{kind}: {outcome}")
        self._count(f"{kind}:{outcome.split(':')[0]}")

    def _params(self) -> dict:
        return {"max_tokens": self.rng.randint(1, 8), "temperature": self.rng.choice([0, 0.7, 1.0]),
                "ignore_eos": self.rng.random() < 0.5, "seed": self.rng.randint(0, 99)}

    async def _complete(self, client, i) -> str:
        body = {"model": MODEL_NAME, "prompt": self.rng.choice(PROMPTS), **self._params()}
        if self.rng.random() < 0.2:
            body["stop"] = [self.rng.choice(["e", " the", "\n"])]
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return f"lost: status {r.status_code} {r.text[:200]}"
        fr = r.json()["choices"][0]["finish_reason"]
        return "ok" if fr in ("stop", "length") else f"lost: finish_reason {fr}"

    async def _chat(self, client, i) -> str:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": self.rng.choice(PROMPTS)}],
                "stream": True, **self._params()}
        finish, done = None, False
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"lost: status {r.status_code}"
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        return f"lost: error event {ev['error']}"
                    for ch in ev.get("choices", ()):
                        finish = ch.get("finish_reason") or finish
        return "ok" if done and finish in ("stop", "length") else f"lost: done={done} finish={finish}"

    async def _cancel(self, client, i) -> str:
        body = {"model": MODEL_NAME, "prompt": self.rng.choice(PROMPTS), "stream": True, "max_tokens": 200,
                "ignore_eos": True}
        keep = self.rng.randint(1, 4)
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"lost: status {r.status_code}"
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if n >= keep:
                        break  # leaving the block closes the connection: a client disconnect
        return "cancelled"

    async def _disconnect(self, client, i) -> str:
        body = {"model": MODEL_NAME, "prompt": self.rng.choice(PROMPTS), "max_tokens": 200, "ignore_eos": True}
        task = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await asyncio.sleep(self.rng.uniform(0.0, 0.05))
        if task.done():
            r = task.result()
            return "ok" if r.status_code == 200 else f"lost: status {r.status_code}"
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return "cancelled"

    async def _invalid(self, client, i) -> str:
        import httpx

        path, body, headers = self.rng.choice(self.invalid)
        h = {"content-type": "application/json", **headers}
        if body is None:
            r = await client.get(path, headers=h)
        else:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            try:
                r = await client.post(path, content=data, headers=h)
            except httpx.TransportError:
                # an oversized body is refused (413) before the server reads it, and the connection
                # closed: a client still sending may see the reset instead of the 413
                if len(data) > 4 * 2**20:
                    return "rejected"
                raise
        if 400 <= r.status_code < 500:
            try:
                err = r.json()["error"]
            except Exception:  # noqa: BLE001
                return f"lost: {r.status_code} without an OpenAI error body"
            return "rejected" if err.get("message") else "lost: empty error message"
        return f"lost: status {r.status_code} for {path} {str(body)[:80]}"

    async def _ws(self, client, i) -> str:
        import websockets

        cancel = self.rng.random() < 0.5
        async with websockets.connect(f"ws://127.0.0.1:{self.port}/v1/ws/chat", max_size=None) as ws:
            await ws.send(json.dumps({"type": "chat", "id": i, "max_tokens": 100 if cancel else 6, "ignore_eos": True,
                                      "messages": [{"role": "user", "content": self.rng.choice(PROMPTS)}]}))
            sent_cancel = False
            while True:
                f = json.loads(await ws.recv())
                if f["type"] == "error":
                    return f"lost: error frame {f['error']}"
                if f["type"] == "delta" and cancel and not sent_cancel:
                    await ws.send(json.dumps({"type": "cancel", "id": i}))
                    sent_cancel = True
                if f["type"] == "done":
                    ok = f["finish_reason"] in (("abort", "length", "stop") if cancel else ("length", "stop"))
                    return ("cancelled" if f["finish_reason"] == "abort" else "ok") if ok else \
                        f"lost: finish_reason {f['finish_reason']}"

    async def run(self, n: int, concurrency: int, start: int = 0) -> None:
        import httpx

        sem = asyncio.Semaphore(concurrency)
        # idle connections are dropped by the client before the server's keep-alive timeout (5 s)
        # could close one just as a request is sent on it (a client-side race, not a server fault)
        limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency,
                              keepalive_expiry=2.0)
        async with httpx.AsyncClient(base_url=self.base, timeout=self.guard_s, limits=limits) as client:
            async def task(i):
                async with sem:
                    await self.one(client, i)

            await asyncio.gather(*(task(start + i) for i in range(n)))


def public_stats(base_url: str) -> dict:
    """The engine gauges of /metrics (the server's public stats)."""
    import httpx

    out = {}
    for line in httpx.get(base_url + "/metrics", timeout=HANG_GUARD_S).text.splitlines():
        if line.startswith("asyncengine_") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(base_url: str) -> dict:
    """Bounded wait until the engine runs and queues nothing; returns the public stats then."""
    for _ in range(int(HANG_GUARD_S / 0.05)):
        s = public_stats(base_url)
        if s.get("asyncengine_num_requests_running") == 0 and s.get("asyncengine_num_requests_waiting") == 0 \
                and s.get("asyncengine_kv_cache_free_blocks") == s.get("asyncengine_kv_cache_blocks"):
            return s
        time.sleep(0.05)
    return public_stats(base_url)


def soak(server: ServerProcess, requests: int, concurrency: int, seed: int = 0, warmup_frac: float = 0.1) -> dict:
    """Run the soak against a started server; the figures (server stays up)."""
    s = Soak(server.base_url, seed)
    warm = max(1, int(requests * warmup_frac))
    t0 = time.perf_counter()
    asyncio.run(s.run(warm, concurrency))
    wait_idle(server.base_url)
    rss_warm = server.rss_bytes()
    server.reset_lag()
    time.sleep(0.5)
    asyncio.run(s.run(requests - warm, concurrency, start=warm))
    stats = wait_idle(server.base_url)
    elapsed = time.perf_counter() - t0
    rss_end = server.rss_bytes()
    blocks = stats.get("asyncengine_kv_cache_blocks", float("nan"))
    free = stats.get("asyncengine_kv_cache_free_blocks", float("nan"))
    return {"requests": requests, "concurrency": concurrency, "elapsed_s": elapsed,
            "outcomes": dict(sorted(s.counts.items())), "lost": len(s.lost), "lost_examples": s.lost[:10],
            "leaked_blocks": blocks - free, "kv_blocks": blocks,
            "running": stats.get("asyncengine_num_requests_running"),
            "waiting": stats.get("asyncengine_num_requests_waiting"),
            "rss_after_warmup_mb": rss_warm / 2**20, "rss_end_mb": rss_end / 2**20,
            "rss_growth": (rss_end - rss_warm) / rss_warm}


def make_tiny_model(path: str) -> str:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from model_utils import make_tiny_checkpoint

    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_checkpoint(path, "llama", tokenizer=True)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--stats", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="a model folder (default: a tiny random Llama made on the fly)")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(_serve_with_uvloop(args))
        return 0
    model = args.model or make_tiny_model(os.path.join(tempfile.gettempdir(), "asyncengine-soak-model"))
    server = ServerProcess(model, args.max_model_len, args.num_kv_blocks, args.max_num_seqs)
    try:
        server.wait_ready()
        res = soak(server, args.requests, args.concurrency, args.seed)
    finally:
        lag = server.stop()
    res.update(lag)
    res["load_avg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(res, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["lost"] == 0 and res["leaked_blocks"] == 0 and res["rss_growth"] < 0.10 else 1


async def _serve_with_uvloop(args) -> None:
    await _serve(args)


if __name__ == "__main__":
    if "--serve" in sys.argv:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
    sys.exit(main())
