"""Hostile requests and hostile pages against a real server on 127.0.0.1: bounded bodies (413 before
reading, chunked too), JSON depth, the limits of validation.py with OpenAI-shaped 400s naming them,
Host / Origin / Content-Type / CORS protections, faults that stay with their request, no traceback
ever sent to a client, and keys kept out of URLs and logs."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket

import httpx
import pytest
import websockets

from asyncengine.engine.validation import RequestLimits
from asyncengine.config import EngineConfig
from asyncengine.integrations.openai_server.security import RedactQuerySecrets, redact
from live_server import API_KEY, HANG_GUARD_S, MODEL, LiveServer, make_engine

APP_ORIGIN = "https://app.example"
LIMITS = RequestLimits(max_request_bytes=64 * 1024, max_n=4, max_stop_strings=4)


@pytest.fixture(scope="module")
def limited(tiny_llama_dir):
    """Small body limit, max_n=4, CORS + Origin allowed for APP_ORIGIN."""
    s = LiveServer(make_engine(tiny_llama_dir, max_model_len=128, num_kv_blocks=64, limits=LIMITS),
                   allowed_origins=[APP_ORIGIN]).start()
    yield s
    s.stop()


def post(server, path: str, body, **headers) -> httpx.Response:
    h = {"content-type": "application/json", **headers}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=data, headers=h, timeout=HANG_GUARD_S)


def assert_error(r: httpx.Response, status: int, *fragments, code=None, param=None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for f in fragments:
        assert f in err["message"], err
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    assert "Traceback" not in r.text
    return err


def healthy(server) -> None:
    assert httpx.get(server.base_url + "/health", timeout=HANG_GUARD_S).status_code == 200
    server.wait_clean()


# ---------------------------------------------------------------- bodies


def _raw_request(server, head: str, chunks, read_after_each: bool = False) -> bytes:
    """Send a hand-made HTTP request (some body chunks, maybe never all of it) and return what the
    server answers: it must answer without waiting for the rest."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD_S) as s:
        s.sendall(head.encode())
        for c in chunks:
            try:
                s.sendall(c)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed: fine
        s.settimeout(HANG_GUARD_S)
        data = b""
        while b"\r\n\r\n" not in data:
            got = s.recv(65536)
            if not got:
                break
            data += got
        return data


def test_content_length_over_limit_is_413_before_the_body(limited):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{limited.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n")
    resp = _raw_request(limited, head, [b"{" + b" " * 1000])  # 1 KB of the announced 10 MB
    assert resp.startswith(b"HTTP/1.1 413"), resp[:200]
    healthy(limited)


def test_chunked_body_over_limit_is_413_while_streaming(limited):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{limited.port}\r\n"
            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b" " * 16384
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    # 6 x 16 KiB > 64 KiB, and the terminating chunk is never sent
    resp = _raw_request(limited, head, [chunk] * 6)
    assert resp.startswith(b"HTTP/1.1 413"), resp[:200]
    healthy(limited)


def test_big_body_via_httpx_is_413(limited):
    r = post(limited, "/v1/completions", {"model": MODEL, "prompt": "x" * 100_000})
    assert_error(r, 413, "max_request_bytes=65536", code="request_too_large")


def test_deep_json_is_400_without_a_traceback(server, caplog):
    caplog.set_level(logging.DEBUG)
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = b'{"model": "tiny-llama", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
        r = post(server, path, body)
        assert_error(r, 400, "max_json_depth=64", code="limit_exceeded")
    assert "RecursionError" not in caplog.text and "Traceback" not in caplog.text
    healthy(server)


# ---------------------------------------------------------------- limits over HTTP


def test_stop_strings_bounded(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": ["x" * 80_000]})
    assert_error(r, 400, "max_stop_string_chars=1024", code="limit_exceeded", param="stop")
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, "stop": [f"s{i}" for i in range(17)]})
    assert_error(r, 400, "max_stop_strings=16", code="limit_exceeded")
    # within the limits, long stop strings cost nothing special
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True,
                                         "stop": ["y" * 1024] * 16})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    healthy(server)


def test_prompt_chars_before_tokenizing(server, monkeypatch):
    calls = []
    tok = server.engine.tokenizer
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * (32 * 1024 + 1), "max_tokens": 1})
    assert_error(r, 400, "max_prompt_chars=32768", code="limit_exceeded", param="prompt")
    r = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                              "messages": [{"role": "user", "content": "x" * 40_000}]})
    assert_error(r, 400, "max_prompt_chars=32768", param="messages")
    assert calls == []
    healthy(server)


def test_sampling_limits_over_http(limited, server):
    r = post(limited, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 5, "max_tokens": 1})
    assert_error(r, 400, "max_n=4", code="limit_exceeded", param="n")
    r = post(limited, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                          "stop": ["a", "b", "c", "d", "e"]})
    assert_error(r, 400, "max_stop_strings=4", param="stop")
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                         "stop_token_ids": list(range(3, 300))})
    assert_error(r, 400, "max_stop_token_ids=256", param="stop_token_ids")
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                         "logit_bias": {str(i): 1 for i in range(3, 500)}, "stop_token_ids": [5] * 1000})
    assert r.status_code == 200  # duplicate stop ids are dropped, 497 bias entries are within 1024
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                         "logit_bias": {"3": 1e400}})
    assert r.status_code == 400
    healthy(server)
    healthy(limited)


@pytest.mark.parametrize("messages, param", [
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
])
def test_bad_messages_over_http(server, messages, param):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1})
    assert_error(r, 400, param=param)


# ---------------------------------------------------------------- browsers: Host, Origin, Content-Type, CORS


def test_host_allow_list(server):
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example", "localhostx"):
        r = httpx.get(server.base_url + "/v1/models", headers={"host": host}, timeout=HANG_GUARD_S)
        assert_error(r, 403, "is not allowed", code="host_not_allowed")
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}", "localhost"):
        assert httpx.get(server.base_url + "/v1/models", headers={"host": host}).status_code == 200


def test_origin_checked_on_state_changing_requests(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for origin in ("http://evil.example", "null", f"http://localhost.evil.example:{server.port}"):
        assert_error(post(server, "/v1/completions", body, origin=origin), 403, code="origin_not_allowed")
    r = post(server, "/v1/completions", body, origin=f"http://127.0.0.1:{server.port}")  # the page's own
    assert r.status_code == 200
    assert post(server, "/v1/completions", body).status_code == 200  # not a browser: no Origin
    # a cross-site "simple" request (no preflight) is refused by its content type alone
    r = httpx.post(server.base_url + "/v1/completions", content=json.dumps(body),
                   headers={"content-type": "text/plain"}, timeout=HANG_GUARD_S)
    assert_error(r, 415, "application/json", code="unsupported_media_type")
    r = httpx.post(server.base_url + "/v1/chat/completions", data={"x": "1"}, timeout=HANG_GUARD_S)
    assert r.status_code == 415


def test_cors_off_by_default_and_on_when_configured(server, limited):
    pre = {"origin": APP_ORIGIN, "access-control-request-method": "POST",
           "access-control-request-headers": "authorization, content-type"}
    r = httpx.options(server.base_url + "/v1/completions", headers=pre)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(server.base_url + "/v1/models", headers={"origin": APP_ORIGIN})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(limited.base_url + "/v1/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
    r = post(limited, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}, origin=APP_ORIGIN)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
    r = post(limited, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1},
             origin="https://other.example")
    assert_error(r, 403, code="origin_not_allowed")


async def test_websocket_origin_and_host(server):
    hello = json.dumps({"type": "ping", "id": 1})
    for kw in ({"origin": "http://evil.example"}, {"additional_headers": {"Host": "evil.example"}}):
        with pytest.raises(websockets.exceptions.InvalidStatus) as e:
            async with websockets.connect(server.ws_url, **kw):
                pass
        assert e.value.response.status_code == 403
    async with websockets.connect(server.ws_url, origin=f"http://127.0.0.1:{server.port}") as ws:
        await ws.send(hello)
        assert json.loads(await asyncio.wait_for(ws.recv(), HANG_GUARD_S))["type"] == "pong"


async def test_websocket_frame_limits(limited):
    async with websockets.connect(limited.ws_url) as ws:
        await ws.send(json.dumps({"type": "chat", "id": 1, "messages": [{"role": "user", "content": "x" * 70_000}]}))
        f = json.loads(await asyncio.wait_for(ws.recv(), HANG_GUARD_S))
        assert f["type"] == "error" and "max_request_bytes=65536" in f["error"]["message"]
        await ws.send("[" * 100 + "]" * 100)
        f = json.loads(await asyncio.wait_for(ws.recv(), HANG_GUARD_S))
        assert f["type"] == "error" and "max_json_depth=64" in f["error"]["message"]
        await ws.send(json.dumps({"type": "chat", "id": 2, "messages": [{"role": "user", "content": "hi"}],
                                  "stop": ["s"] * 5}))
        f = json.loads(await asyncio.wait_for(ws.recv(), HANG_GUARD_S))
        assert f["type"] == "error" and f["id"] == 2 and "max_stop_strings=4" in f["error"]["message"]
        await ws.send(json.dumps({"type": "ping"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), HANG_GUARD_S))["type"] == "pong"


# ---------------------------------------------------------------- faults stay with their request


def test_output_fault_fails_one_request_not_the_server(make_server):
    srv = make_server()
    proc = srv.engine.output_processor
    real = proc._process_one

    def poisoned(st, s, co, now, to_abort):
        if st.prompt and "POISON" in st.prompt and s.token_ids:
            raise RuntimeError("simulated stop-matcher fault")
        return real(st, s, co, now, to_abort)

    proc._process_one = poisoned
    with httpx.Client(base_url=srv.base_url, timeout=HANG_GUARD_S, headers={"content-type": "application/json"}) as c:
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 30,
                                                      "ignore_eos": True, "stream": True}) as good:
            lines = good.iter_lines()
            next(lines)
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "POISON", "max_tokens": 5,
                                                "ignore_eos": True})
            err = assert_error(r, 500, "failed while its output was processed", code="request_failed")
            assert "simulated stop-matcher fault" in err["message"]
            # the stream next to it carries on to the end
            rest = "\n".join(lines)
            assert '"finish_reason":"length"' in rest and rest.rstrip().endswith("data: [DONE]")
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "POISON", "max_tokens": 5, "stream": True,
                                            "ignore_eos": True})
        assert r.status_code == 200 and '"code":"request_failed"' in r.text
    assert httpx.get(srv.base_url + "/health").status_code == 200 and not srv.engine.errored
    srv.wait_clean()


def test_tokenizer_fault_is_400(server, monkeypatch):
    tok = server.engine.tokenizer
    real = tok.encode

    def flaky(text, *a, **k):
        if "BOOM" in text:
            raise RuntimeError("no such byte")
        return real(text, *a, **k)

    monkeypatch.setattr(tok, "encode", flaky)
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "BOOM", "max_tokens": 1})
    assert_error(r, 400, "the tokenizer cannot encode this prompt: RuntimeError", param="prompt")
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "BOOM " * 2000, "max_tokens": 1})  # off-loop
    assert_error(r, 400, "tokenizer cannot encode")
    healthy(server)


def test_internal_error_leaks_no_traceback(server, monkeypatch, caplog):
    def broken():
        raise KeyError("secret internal detail")

    monkeypatch.setattr(server.state.metrics, "render", broken)
    caplog.set_level(logging.ERROR)
    r = httpx.get(server.base_url + "/metrics", timeout=HANG_GUARD_S)
    err = assert_error(r, 500, "internal error (reference ", code="internal_error")
    assert "secret internal detail" not in r.text and "KeyError" not in r.text
    ref = err["message"].split("reference ")[1].rstrip(")")
    assert ref in caplog.text and "secret internal detail" in caplog.text  # the operator sees it


# ---------------------------------------------------------------- keys


def test_key_covers_everything_but_health(strict_server):
    base = strict_server.base_url
    assert httpx.get(base + "/health").status_code == 200
    for path in ("/metrics", "/openapi.json", "/v1/models"):
        assert_error(httpx.get(base + path), 401, code="invalid_api_key")
        assert httpx.get(base + path, headers={"authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(base + "/v1/models?api_key=" + API_KEY).status_code == 401  # never in a URL
    assert httpx.get(base + "/").status_code == 200  # the static page: it holds no data, it asks for the key


def test_metrics_public_opt_out(tiny_llama_dir):
    s = LiveServer(make_engine(tiny_llama_dir, max_model_len=64, num_kv_blocks=16), api_key=API_KEY,
                   metrics_public=True).start()
    try:
        assert httpx.get(s.base_url + "/metrics").status_code == 200
        assert httpx.get(s.base_url + "/v1/models").status_code == 401
    finally:
        s.stop()


def test_access_log_redacts_query_secrets():
    assert redact("/v1/ws/chat?api_key=sk-123&x=1") == "/v1/ws/chat?api_key=[REDACTED]&x=1"
    assert redact("/p?a=1&token=abc&Key=zzz") == "/p?a=1&token=[REDACTED]&Key=[REDACTED]"
    # what uvicorn's access logger formats: (client, method, path with query, http version, status)
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/v1/ws/chat?api_key=sk-123", "1.1", 101), None)
    assert RedactQuerySecrets().filter(record)
    assert "sk-123" not in record.getMessage() and "[REDACTED]" in record.getMessage()
    assert any(isinstance(f, RedactQuerySecrets) for f in logging.getLogger("uvicorn.access").filters)


async def test_ws_key_as_subprotocol_is_not_echoed(strict_server):
    b64 = base64.urlsafe_b64encode(API_KEY.encode()).decode().rstrip("=")
    async with websockets.connect(strict_server.ws_url, subprotocols=["asyncengine.v1", "asyncengine.key." + b64]) as ws:
        assert ws.subprotocol == "asyncengine.v1"
        assert API_KEY not in str(ws.response.headers)


# ---------------------------------------------------------------- configuration


def test_default_allowed_hosts():
    from asyncengine.integrations.openai_server.security import SecurityPolicy, default_allowed_hosts

    assert "localhost" in default_allowed_hosts("127.0.0.1") and "evil.example" not in default_allowed_hosts("::1")
    assert default_allowed_hosts("10.1.2.3") == {"10.1.2.3"}
    wildcard = SecurityPolicy(None, bind_host="0.0.0.0")
    assert wildcard.check_host({b"host": b"192.168.1.7:8000"}) is None  # an IP literal: no rebinding possible
    assert wildcard.check_host({b"host": b"evil.example"}) is not None
    extra = SecurityPolicy(None, bind_host="10.1.2.3", allowed_hosts=["llm.internal"])
    assert extra.check_host({b"host": b"llm.internal:8000"}) is None
    assert extra.check_host({b"host": b"localhost:8000"}) is not None
    assert SecurityPolicy(None, allowed_hosts=["*"]).check_host({b"host": b"anything"}) is None
    # two Host headers are never "allowed"
    from asyncengine.integrations.openai_server.security import _headers

    assert SecurityPolicy(None).check_host(_headers({"headers": [(b"host", b"localhost"), (b"host", b"evil")]}))


def test_serve_flags_reach_the_engine_and_the_app(monkeypatch):
    import asyncengine.integrations.openai_server as server_pkg
    from asyncengine import cli

    seen = {}
    model = "smollm2-135m-instruct"  # a model the CLI accepts before loading (serve never loads it here)
    monkeypatch.setattr(server_pkg, "serve", lambda **kw: seen.update(kw) or 0)
    assert cli.main(["serve", model, "--max-num-seqs", "8", "--max-queued-requests", "3",
                     "--max-queued-tokens", "500", "--max-request-bytes", "1000", "--max-prompt-chars", "900",
                     "--max-stop-strings", "2", "--max-stop-string-chars", "10", "--max-n", "2",
                     "--allowed-hosts", "llm.internal, other", "--allowed-origins", "https://app.example",
                     "--metrics-public"]) == 0
    cfg = seen["engine_config"]  # serve builds its EngineConfig once, from the flags (cli.args.engine_config_of)
    assert (cfg.max_num_seqs, cfg.max_queued_requests, cfg.max_queued_tokens) == (8, 3, 500)
    assert cfg.limits == RequestLimits(max_request_bytes=1000, max_prompt_chars=900, max_stop_strings=2,
                                       max_stop_string_chars=10, max_n=2)
    assert seen["allowed_hosts"] == ["llm.internal", "other"] and seen["allowed_origins"] == ["https://app.example"]
    assert seen["metrics_public"] is True
    # flags not given keep EngineConfig's own defaults
    default = EngineConfig(model=model)
    assert (cfg.tp_vocab_parallel, cfg.ray_placement_strategy) == (default.tp_vocab_parallel,
                                                                    default.ray_placement_strategy)
    seen.clear()
    assert cli.main(["serve", model, "--no-tp-vocab-parallel", "--ray-placement-strategy", "STRICT_SPREAD"]) == 0
    cfg = seen["engine_config"]
    assert cfg.tp_vocab_parallel is False and cfg.ray_placement_strategy == "STRICT_SPREAD"
    seen.clear()
    assert cli.main(["serve", model]) == 0
    cfg = seen["engine_config"]
    assert cfg.max_queued_requests == default.max_queued_requests and cfg.limits == RequestLimits()
    with pytest.raises(SystemExit) as bad:  # a bad limit is a usage error at the flags' check, not a traceback
        cli.main(["serve", model, "--max-n", "0"])
    assert bad.value.code == 2


def test_413_closes_the_connection(limited):
    r = post(limited, "/v1/completions", {"model": MODEL, "prompt": "x" * 100_000})
    assert r.status_code == 413 and r.headers["connection"] == "close"
