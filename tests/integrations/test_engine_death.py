"""The engine dies (a fault in the model's forward) while clients are mid-stream: over SSE
(completions and chat) and over websockets, every open generation gets a clear error event naming
the fault, then its stream ends or its connection closes; nothing hangs.

The fault goes in through ``model_utils.model_hook``. Every forward pass first takes a credit the
test hands out one at a time, so the streams are exactly as far along as the test says (each has
streamed something, none can finish) when it arms the fault, however fast or slow the machine.
"""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
import websockets

from live_server import HANG_GUARD_S, MODEL
from model_utils import model_hook

FAULT = "simulated kernel fault"
NO_EOS = {"ignore_eos": True}


class Throttle:
    """The hook: each forward waits for a credit; once ``fail`` is set, the next one raises."""

    def __init__(self) -> None:
        self.credits = threading.Semaphore(0)
        self.fail = threading.Event()
        self.calls = 0

    def __call__(self, k: int) -> None:
        assert self.credits.acquire(timeout=HANG_GUARD_S), "the test never released this forward"
        self.calls = k + 1
        if self.fail.is_set():
            raise RuntimeError(FAULT)

    async def step_until(self, cond, max_steps: int = 40) -> None:
        """Allow one forward at a time until ``cond()`` holds (checked between forwards)."""
        for _ in range(max_steps):
            if cond():
                return
            before = self.calls
            self.credits.release()
            for _ in range(int(HANG_GUARD_S / 0.005)):
                if self.calls > before:
                    break
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.02)  # let the outputs of that step reach the clients
        assert cond(), f"not reached after {max_steps} steps"

    def kill(self) -> None:
        self.fail.set()
        for _ in range(4):
            self.credits.release()


def sse_events(raw: list[str]) -> list:
    """The data payloads of an SSE body's lines (JSON decoded, except ``[DONE]``)."""
    out = []
    for line in raw:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_engine_death_mid_sse_stream(make_server):
    srv = make_server(max_model_len=1024)
    throttle = Throttle()
    lines: list[str] = []
    got_chat: list = []
    errors: list = []
    with model_hook(srv.engine, throttle):
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=HANG_GUARD_S) as http, \
                openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0,
                                   timeout=HANG_GUARD_S) as client:
            async def completion():
                body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 900, "stream": True,
                        **NO_EOS}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        lines.append(line)

            async def chat():
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=900, stream=True,
                    extra_body=NO_EOS)
                try:
                    async for chunk in stream:
                        got_chat.append(chunk)
                except openai.APIError as e:  # the client's own exception for an error event
                    errors.append(e)

            tasks = [asyncio.create_task(completion()), asyncio.create_task(chat())]

            def both_streaming() -> bool:
                texts = [e for e in sse_events(lines) if isinstance(e, dict) and e.get("choices")
                         and e["choices"][0].get("text")]
                return bool(texts) and any(c.choices and c.choices[0].delta.content for c in got_chat)

            await throttle.step_until(both_streaming)
            throttle.kill()
            await asyncio.wait_for(asyncio.gather(*tasks), HANG_GUARD_S)  # both streams end

    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    err = events[-2]
    assert set(err) == {"error"} and err["error"]["code"] == "engine_dead", err
    assert FAULT in err["error"]["message"]
    assert not any(isinstance(e, dict) and "error" in e for e in events[:-2])
    texts = [e["choices"][0]["text"] for e in events[:-2] if e.get("choices")]
    assert any(texts) and not any(e["choices"][0].get("finish_reason") for e in events[:-2] if e.get("choices"))
    (e,) = errors
    assert FAULT in str(e) and any(c.choices and c.choices[0].delta.content for c in got_chat)
    # the server says so too, and refuses new work with the same error
    assert (await asyncio.to_thread(httpx.get, srv.base_url + "/health")).status_code >= 500
    with pytest.raises(openai.InternalServerError) as ei:
        await asyncio.to_thread(openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
                                .completions.create, model=MODEL, prompt="hi", max_tokens=2)
    assert ei.value.code == "engine_dead"


def chat_frame(cid, max_tokens: int = 900) -> str:
    return json.dumps({"type": "chat", "id": cid, "messages": [{"role": "user", "content": f"Hello {cid}"}],
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


async def test_engine_death_with_websockets_open(make_server):
    srv = make_server(max_model_len=1024)
    throttle = Throttle()
    frames: dict[str, list[dict]] = {"one": [], "two": []}
    closed: dict[str, object] = {}

    async def reader(name, ws):
        try:
            while True:
                frames[name].append(json.loads(await ws.recv()))
        except websockets.ConnectionClosed as e:
            closed[name] = e

    def deltas(name) -> set:
        return {f["id"] for f in frames[name] if f["type"] == "delta"}

    with model_hook(srv.engine, throttle):
        async with websockets.connect(srv.ws_url) as one, websockets.connect(srv.ws_url) as two, \
                websockets.connect(srv.ws_url) as idle:
            await one.send(chat_frame("a"))
            await one.send(chat_frame("b"))
            await two.send(chat_frame("c"))
            readers = [asyncio.create_task(reader("one", one)), asyncio.create_task(reader("two", two))]
            await throttle.step_until(lambda: deltas("one") == {"a", "b"} and deltas("two") == {"c"})
            throttle.kill()
            await asyncio.wait_for(asyncio.gather(*readers), HANG_GUARD_S)  # both connections close

            # every generation got its error frame, naming the fault, and nothing after it
            for name, ids in (("one", {"a", "b"}), ("two", {"c"})):
                errs = [f for f in frames[name] if f["type"] == "error"]
                assert {f["id"] for f in errs} == ids and len(errs) == len(ids), frames[name]
                for f in errs:
                    assert f["error"]["code"] == "engine_dead" and FAULT in f["error"]["message"]
                    later = frames[name][frames[name].index(f) + 1:]
                    assert not any(g["id"] == f["id"] for g in later)
                assert not any(f["type"] == "done" for f in frames[name])
                assert closed[name].rcvd is not None and closed[name].rcvd.code == 1011

            # a connection that was idle: its next chat gets the error, then the close
            await idle.send(chat_frame("late", 4))
            f = json.loads(await asyncio.wait_for(idle.recv(), HANG_GUARD_S))
            assert f["type"] == "error" and f["id"] == "late" and f["error"]["code"] == "engine_dead"
            with pytest.raises(websockets.ConnectionClosed) as ei:
                await asyncio.wait_for(idle.recv(), HANG_GUARD_S)
            assert ei.value.rcvd.code == 1011
