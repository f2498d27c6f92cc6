"""A bigger fuzz of every endpoint (each HTTP route of /openapi.json and the websocket chat): over
2,000 generated HTTP requests plus 300 websocket frames (schemathesis from the served OpenAPI document, valid and invalid;
hypothesis-mutated bodies and headers; random websocket frames), none answered with a 5xx, and the
server healthy and clean afterwards. Derandomized (the same requests every run), tiny generations
(a 64-token context, max_tokens <= 4), so it stays CI-fast."""
from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest
import schemathesis
import websockets
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from live_server import HANG_GUARD_S, MODEL
from test_fuzz import small

MIN_REQUESTS = 2000
# schemathesis generates slowly (0.1-0.3 s a case here): it covers every route and the schema's
# corners; the bulk of the requests comes from the cheaper hypothesis strategies below
POSITIVE = {"POST /v1/completions": 30, "POST /v1/chat/completions": 30, "GET /v1/models": 5,
            "GET /v1/models/{model}": 40, "GET /health": 5, "GET /metrics": 5, "GET /openapi.json": 5}
NEGATIVE = {"POST /v1/completions": 60, "POST /v1/chat/completions": 20}
MUTATIONS = 600  # per endpoint
HEADER_CASES = 720
WS_FRAMES = 300
HYPOTHESIS = dict(deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                    | st.text(max_size=20),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=20)
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stop", "logit_bias", "stop_token_ids",
          "temperature", "top_p", "top_k", "min_p", "logprobs", "top_logprobs", "seed", "stream", "stream_options",
          "min_tokens", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "echo",
          "include_stop_str_in_output", "model", "best_of", "suffix", "user"]


def _requests_served(server) -> float:
    total = 0.0
    for metric in server.state.metrics.http_requests.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                total += sample.value
    return total


def _op(schema, key: str):
    method, path = key.split(" ", 1)
    return schema[path][method]


def _no_5xx(r: httpx.Response, what) -> None:
    assert r.status_code < 500, (what, r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert "Traceback" not in r.text and r.json()["error"]["message"], (what, r.text[:500])


def test_fuzz_every_endpoint(fuzz_server):
    base = fuzz_server.base_url
    start = _requests_served(fuzz_server)
    doc = httpx.get(base + "/openapi.json").json()
    tight = small(doc)
    for req in ("CompletionRequest", "ChatCompletionRequest"):
        props = tight["components"]["schemas"][req]["properties"]
        props["max_tokens"]["anyOf"][0]["maximum"] = 4
        if "max_completion_tokens" in props:
            props["max_completion_tokens"]["anyOf"][0]["maximum"] = 4
    positive, negative = schemathesis.openapi.from_dict(tight), schemathesis.openapi.from_dict(doc)

    # 1. schemathesis: valid requests of every route, then invalid ones where there is input
    for schema, plan, mode in ((positive, POSITIVE, GenerationMode.POSITIVE),
                               (negative, NEGATIVE, GenerationMode.NEGATIVE)):
        for key, count in plan.items():
            @settings(max_examples=count, **HYPOTHESIS)
            @given(case=_op(schema, key).as_strategy(generation_mode=mode))
            def run(case):
                case.call_and_validate(base_url=base, timeout=60, checks=[not_a_server_error])

            t0 = time.perf_counter()
            run()
            if os.environ.get("FUZZ_TIMES"):
                print(f"{key} {mode}: {count} in {time.perf_counter() - t0:.1f} s")

    # 2. a valid body with one field replaced by any JSON value (or dropped)
    with httpx.Client(base_url=base, timeout=HANG_GUARD_S, headers={"content-type": "application/json"}) as c:
        bases = {"/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                 "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 2}}
        for path, valid in bases.items():
            @settings(max_examples=MUTATIONS, **HYPOTHESIS)
            @given(field=st.sampled_from(FIELDS), value=JSON, drop=st.booleans())
            def mutate(field, value, drop):
                body = dict(valid)
                if drop and field in body:
                    del body[field]
                else:
                    body[field] = value
                    if field not in ("max_tokens", "max_completion_tokens"):
                        body.setdefault("max_tokens", 2)
                _no_5xx(c.post(path, content=json.dumps(body)), body)

            t0 = time.perf_counter()
            mutate()
            if os.environ.get("FUZZ_TIMES"):
                print(f"mutations {path}: {time.perf_counter() - t0:.1f} s")

        # 3. hostile headers and raw bodies
        @settings(max_examples=HEADER_CASES, **HYPOTHESIS)
        @given(host=st.sampled_from([None, "evil.example", "localhost", "127.0.0.1:1", "[::1]", "", "a" * 300]),
               origin=st.sampled_from([None, "null", "http://evil.example", base, "file://", "http://127.0.0.1"]),
               ctype=st.sampled_from(["application/json", "text/plain", "application/json; charset=utf-8",
                                      "multipart/form-data", "", "application/x-www-form-urlencoded"]),
               body=st.sampled_from([b"", b"{", b"[]", b"null", b'{"model": "tiny-llama", "prompt": "hi", '
                                     b'"max_tokens": 1}', b"\xff\xfe", b"[" * 200 + b"]" * 200]),
               path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/nope"]))
        def headers(host, origin, ctype, body, path):
            h = {"content-type": ctype}
            if host is not None:
                h["host"] = host
            if origin is not None:
                h["origin"] = origin
            r = c.post(path, content=body, headers=h) if path.startswith("/v1/c") else c.get(path, headers=h)
            assert r.status_code < 500, (path, h, body[:40], r.status_code, r.text[:300])

        t0 = time.perf_counter()
        headers()
        if os.environ.get("FUZZ_TIMES"):
            print(f"headers: {time.perf_counter() - t0:.1f} s")

    # 4. websocket frames, all on one connection, which must survive them
    frames = st.one_of(
        JSON.map(lambda v: json.dumps(v)),
        st.text(max_size=40),
        st.fixed_dictionaries({"type": st.sampled_from(["chat", "cancel", "ping", "x"]),
                               "id": st.one_of(st.none(), st.integers(), st.text(max_size=5), st.booleans()),
                               "messages": st.one_of(JSON, st.just([{"role": "user", "content": "hi"}])),
                               "max_tokens": st.one_of(st.integers(-2, 4), JSON)}).map(json.dumps))
    sent: list[str] = []

    @settings(max_examples=WS_FRAMES, **HYPOTHESIS)
    @given(frame=frames)
    def collect(frame):
        sent.append(frame)

    collect()

    async def ws_run() -> None:
        async with websockets.connect(fuzz_server.ws_url) as ws:
            for f in sent:
                await ws.send(f)
            await ws.send(json.dumps({"type": "ping", "id": "end"}))
            while True:
                got = json.loads(await asyncio.wait_for(ws.recv(), HANG_GUARD_S))
                if got.get("type") == "error":
                    assert got["error"]["type"] != "internal_server_error", got
                if got == {"type": "pong", "id": "end"}:
                    break

    t0 = time.perf_counter()
    asyncio.run(ws_run())
    if os.environ.get("FUZZ_TIMES"):
        print(f"websocket: {time.perf_counter() - t0:.1f} s")

    served = _requests_served(fuzz_server) - start
    if os.environ.get("FUZZ_TIMES"):
        print(f"served {served} HTTP requests + {len(sent)} websocket frames")
    assert served >= MIN_REQUESTS, served  # HTTP requests alone (the websocket frames come on top)
    assert len(sent) == WS_FRAMES
    assert httpx.get(base + "/health").status_code == 200
    fuzz_server.wait_clean("the fuzzed requests to finish")
