"""Connections a hostile client holds: a cap on websockets plus in-flight /v1/ requests (503, or a
refused handshake, past it; /health always answers), an idle timeout for websockets (a running
generation is not idle), a 413 that AsyncOpenAI reads as a 413 (not a ReadError), and no secret
of a refused websocket URL in any log line."""
from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest
import websockets

from asyncengine.engine.validation import RequestLimits
from live_server import API_KEY, HANG_GUARD_S, MODEL, LiveServer, make_engine


@pytest.fixture(scope="module")
def capped(tiny_llama_dir):
    s = LiveServer(make_engine(tiny_llama_dir, limits=RequestLimits(max_request_bytes=1 << 20)), own_engine=True,
                   max_connections=2, ws_idle_timeout_s=0.5).start()
    yield s
    s.stop()


def test_connection_cap(capped):
    async def main():
        a = await websockets.connect(capped.ws_url)
        b = await websockets.connect(capped.ws_url)
        with pytest.raises(websockets.exceptions.InvalidStatus):
            await websockets.connect(capped.ws_url)
        async with httpx.AsyncClient() as c:
            r = await c.get(capped.base_url + "/v1/models")
            assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
            assert r.headers["retry-after"] == "1"
            assert (await c.get(capped.base_url + "/health")).status_code == 200
            await a.close()
            for _ in range(int(HANG_GUARD_S / 0.05)):  # bounded: the server notices the close
                r = await c.get(capped.base_url + "/v1/models")
                if r.status_code == 200:
                    break
                await asyncio.sleep(0.05)
            assert r.status_code == 200
        await b.close()

    asyncio.run(main())


def test_idle_websocket_is_closed_but_a_generating_one_is_not(capped):
    async def main():
        async with websockets.connect(capped.ws_url) as ws:
            await ws.send(json.dumps({"type": "chat", "id": 1, "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 900, "ignore_eos": True}))
            frames = 0
            while True:
                f = json.loads(await asyncio.wait_for(ws.recv(), HANG_GUARD_S))
                frames += 1
                if f["type"] == "done":
                    break
                assert f["type"] == "delta", f
            assert f["usage"]["completion_tokens"] == 900
            # now idle: closed by the server, 1001
            with pytest.raises(websockets.exceptions.ConnectionClosed) as e:
                await asyncio.wait_for(ws.recv(), HANG_GUARD_S)
            assert e.value.rcvd is not None and e.value.rcvd.code == 1001

    asyncio.run(main())


def test_413_is_readable_by_async_clients(capped):
    async def main():
        async with openai.AsyncOpenAI(base_url=capped.base_url + "/v1", api_key="x", max_retries=0,
                                      timeout=HANG_GUARD_S) as c:
            for size in (1_500_000, 3_500_000):  # over the limit, within the drain bound (4 MiB)
                with pytest.raises(openai.APIStatusError) as e:
                    await c.completions.create(model=MODEL, prompt="x" * size, max_tokens=2)
                assert e.value.status_code == 413 and "max_request_bytes=1048576" in str(e.value)
            r = await c.completions.create(model=MODEL, prompt="ok", max_tokens=2)
            assert r.choices

    asyncio.run(main())


def test_no_secret_of_a_refused_websocket_in_the_logs(strict_server):
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep(level=logging.DEBUG)
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn.access")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        async def main():
            with pytest.raises(websockets.exceptions.InvalidStatus):
                await websockets.connect(strict_server.ws_url + "?api_key=sk-leaked-secret-123&x=1")
            async with httpx.AsyncClient() as c:
                r = await c.get(strict_server.base_url + "/v1/models?api_key=sk-leaked-secret-456")
                assert r.status_code == 401
        asyncio.run(main())
    finally:
        for lg, lv in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(lv)
    text = "\n".join(seen)
    assert "WebSocket" in text and "[REDACTED]" in text, text  # the refusal is logged, redacted
    assert "sk-leaked-secret" not in text and API_KEY not in text, text
