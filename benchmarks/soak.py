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

The memory curve (issue 22, "Memory per shape"): ``--curve-every 500`` samples the idle server
every 500 requests (smaps_rollup, glibc's mallinfo2 and arena count, Python's object count, and,
with ``--env ONEDNN_VERBOSE=profile_create``, the oneDNN primitives created so far);
``--prompt-lens 1:200`` sends random token-id prompts so that the batched token count of a step
(every GEMM's M) takes many values; ``--dtype bfloat16`` runs the GEMMs through oneDNN:

    python benchmarks/soak.py --requests 4000 --concurrency 64 --seed 3 --dtype bfloat16 \
        --prompt-lens 1:200 --curve-every 500 --out soak_memory.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak_server import HANG_GUARD_S, MODEL_NAME, ServerProcess, serve  # noqa: E402,F401

PROMPTS = ["The quick brown fox", "def f(x):", "Paris is the capital of", "Once upon a time", "Hello"]


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
    def __init__(self, base_url: str, seed: int = 0, guard_s: float = HANG_GUARD_S,
                 prompt_lens: tuple[int, int] | None = None, max_model_len: int = 256) -> None:
        self.base = base_url
        self.max_model_len = max_model_len
        self.prompt_lens = prompt_lens  # (lo, hi): completions send random token-id prompts of that many
        self.port = int(base_url.rsplit(":", 1)[1])
        self.rng = random.Random(seed)
        self.guard_s = guard_s
        self.invalid = invalid_requests(self.port)
        self.counts: dict[str, int] = {}
        self.lost: list[str] = []

    def _prompt(self):
        """A text prompt, or with ``prompt_lens`` a token-id prompt of a random length (many distinct
        batched token counts: the shapes of every GEMM in a step)."""
        if self.prompt_lens is None:
            return self.rng.choice(PROMPTS)
        return [self.rng.randint(3, 500) for _ in range(self.rng.randint(*self.prompt_lens))]

    def _long(self, prompt) -> int:
        """max_tokens of a request meant to be cut off: 200, within the context a token-id prompt leaves."""
        return 200 if isinstance(prompt, str) else max(1, min(200, self.max_model_len - len(prompt) - 1))

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
        body = {"model": MODEL_NAME, "prompt": self._prompt(), **self._params()}
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
        prompt = self._prompt()
        body = {"model": MODEL_NAME, "prompt": prompt, "stream": True, "max_tokens": self._long(prompt),
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
        prompt = self._prompt()
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": self._long(prompt), "ignore_eos": True}
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


def _point(server: ServerProcess, done: int) -> dict:
    """One point of the RSS curve, taken idle: the server's smaps and malloc figures, and the
    oneDNN primitives it created so far where its verbose log is on."""
    p = server.probe()
    sm = p.pop("smaps", {})
    point = {"requests": done, "rss_mb": sm.get("Rss", server.rss_bytes() / 2**20),
             "anon_mb": sm.get("Anonymous"), **p}
    if server.env.get("ONEDNN_VERBOSE"):
        point["onednn"] = server.onednn_creations()
    return point


def soak(server: ServerProcess, requests: int, concurrency: int, seed: int = 0, warmup_frac: float = 0.1,
         curve_every: int = 0, prompt_lens: tuple[int, int] | None = None, max_model_len: int = 256) -> dict:
    """Run the soak against a started server; the figures (server stays up). ``curve_every`` > 0:
    the server's memory (idle) after the warm-up and after every that many requests."""
    s = Soak(server.base_url, seed, prompt_lens=prompt_lens, max_model_len=max_model_len)
    warm = max(1, int(requests * warmup_frac)) if not curve_every else min(curve_every, requests)
    t0 = time.perf_counter()
    curve = [_point(server, 0)] if curve_every else []
    asyncio.run(s.run(warm, concurrency))
    wait_idle(server.base_url)
    rss_warm = server.rss_bytes()
    if curve_every:
        curve.append(_point(server, warm))
    server.reset_lag()
    time.sleep(0.5)
    done = warm
    while done < requests:
        n = min(curve_every or requests, requests - done)
        asyncio.run(s.run(n, concurrency, start=done))
        done += n
        stats = wait_idle(server.base_url)
        if curve_every:
            curve.append(_point(server, done))
            print(json.dumps({k: curve[-1].get(k) for k in ("requests", "rss_mb", "in_use_mb", "free_mb", "onednn")}),
                  file=sys.stderr, flush=True)
    stats = wait_idle(server.base_url)
    elapsed = time.perf_counter() - t0
    rss_end = server.rss_bytes()
    blocks = stats.get("asyncengine_kv_cache_blocks", float("nan"))
    free = stats.get("asyncengine_kv_cache_free_blocks", float("nan"))
    out = {"requests": requests, "concurrency": concurrency, "elapsed_s": elapsed,
           "outcomes": dict(sorted(s.counts.items())), "lost": len(s.lost), "lost_examples": s.lost[:10],
           "leaked_blocks": blocks - free, "kv_blocks": blocks,
           "running": stats.get("asyncengine_num_requests_running"),
           "waiting": stats.get("asyncengine_num_requests_waiting"),
           "rss_after_warmup_mb": rss_warm / 2**20, "rss_end_mb": rss_end / 2**20,
           "rss_growth": (rss_end - rss_warm) / rss_warm}
    if curve_every:
        out["curve"] = curve
    return out


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return out.split("Model name:")[1].splitlines()[0].strip()
    except (OSError, IndexError):
        return ""


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
    ap.add_argument("--dtype", default="float32", help="the model's dtype (bfloat16 runs oneDNN GEMMs on CPU)")
    ap.add_argument("--prompt-lens", default=None, metavar="LO:HI",
                    help="completions send random token-id prompts of LO..HI tokens (default: short text prompts)")
    ap.add_argument("--curve-every", type=int, default=0, metavar="N",
                    help="record the server's memory (idle) every N requests (the first N are the warm-up)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment for the server process (e.g. ONEDNN_VERBOSE=profile_create)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(args))
        return 0
    model = args.model or make_tiny_model(os.path.join(tempfile.gettempdir(), "asyncengine-soak-model"))
    env = dict(kv.split("=", 1) for kv in args.env)
    lens = tuple(int(v) for v in args.prompt_lens.split(":")) if args.prompt_lens else None
    load_start = os.getloadavg()[0]
    server = ServerProcess(model, args.max_model_len, args.num_kv_blocks, args.max_num_seqs, args.dtype, env)
    try:
        server.wait_ready()
        res = soak(server, args.requests, args.concurrency, args.seed, curve_every=args.curve_every,
                   prompt_lens=lens, max_model_len=args.max_model_len)
    finally:
        lag = server.stop()
    res.update(lag)
    res.update({"command": "python " + " ".join(sys.argv), "dtype": args.dtype, "server_env": env,
                "cpu": _cpu_model(), "load_avg_1m_start": load_start, "load_avg_1m_end": os.getloadavg()[0],
                "date": time.strftime("%Y-%m-%d %H:%M")})
    print(json.dumps(res, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["lost"] == 0 and res["leaked_blocks"] == 0 and res["rss_growth"] < 0.10 else 1


if __name__ == "__main__":
    if "--serve" in sys.argv:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
    sys.exit(main())
