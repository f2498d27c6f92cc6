"""The websocket chat (/v1/ws/chat) with the ``websockets`` client: several conversations on one
connection, cancel frames, disconnects, bad frames, and the API key."""
from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from asyncengine.engine.llm import render_chat
from live_server import API_KEY, HANG_GUARD_S, MODEL

MESSAGES = [{"role": "user", "content": "Tell me about foxes."}]


def chat(cid, max_tokens: int, messages=MESSAGES, **kw) -> str:
    return json.dumps({"type": "chat", "id": cid, "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, **kw})


async def recv(ws) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), HANG_GUARD_S))


async def until_done(ws, ids, frames: list | None = None) -> tuple[list[dict], dict]:
    """Frames until every id in ``ids`` is done: (all frames, {id: done frame}); ``frames``: the
    ones already received."""
    frames = list(frames or [])
    done = {f["id"]: f for f in frames if f["type"] == "done"}
    while not set(ids) <= set(done):
        f = await recv(ws)
        frames.append(f)
        assert f["type"] in ("delta", "done"), f
        if f["type"] == "done":
            done[f["id"]] = f
    return frames, done


async def wait_clean(server) -> None:
    await asyncio.to_thread(server.wait_clean)


async def test_concurrent_conversations_on_one_socket(server):
    lens = {"a": 5, "b": 9, 7: 13}
    msgs = {"a": MESSAGES, "b": [{"role": "user", "content": "Hi"}], 7: [{"role": "user", "content": "Bye"}]}
    async with websockets.connect(server.ws_url) as ws:
        for cid, n in lens.items():
            await ws.send(chat(cid, n, msgs[cid]))
        frames, done = await until_done(ws, lens)
    for cid, n in lens.items():
        d = done[cid]
        assert d["finish_reason"] == "length"
        n_prompt = len(render_chat(server.engine.tokenizer, msgs[cid]))
        assert d["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
        assert any(f["type"] == "delta" and f["id"] == cid for f in frames)
        # nothing of an id after its done frame
        last = max(i for i, f in enumerate(frames) if f["id"] == cid)
        assert frames[last]["type"] == "done"
    # they ran at the same time: the frames of the ids interleave
    order = [f["id"] for f in frames if f["type"] == "delta"]
    switches = sum(1 for x, y in zip(order, order[1:]) if x != y)
    assert switches >= 3, order
    await wait_clean(server)


async def test_ws_text_matches_http_greedy(server, client):
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(chat("x", 10))
        frames, _ = await until_done(ws, ["x"])
    text = "".join(f["text"] for f in frames if f["type"] == "delta")
    r = await asyncio.to_thread(client.chat.completions.create, model=MODEL, messages=MESSAGES, max_tokens=10,
                                temperature=0, extra_body={"ignore_eos": True})
    assert text == r.choices[0].message.content


async def test_cancel_stops_one_conversation_and_frees_its_blocks(server):
    await wait_clean(server)
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(chat("long", 900))
        await ws.send(chat("short", 12))
        seen = []
        while not any(f["type"] == "delta" and f["id"] == "long" for f in seen):
            seen.append(await recv(ws))
        await ws.send(json.dumps({"type": "cancel", "id": "long"}))
        _, done = await until_done(ws, ["long", "short"], seen)
        assert done["long"]["finish_reason"] == "abort"
        assert 0 < done["long"]["usage"]["completion_tokens"] < 900
        assert done["short"]["finish_reason"] == "length"  # the other conversation is untouched
        assert done["short"]["usage"]["completion_tokens"] == 12
        await wait_clean(server)  # blocks freed while the connection is still open
        # the id is free again, and a cancel of an unknown id is ignored
        await ws.send(json.dumps({"type": "cancel", "id": "nobody"}))
        await ws.send(chat("long", 3))
        _, done = await until_done(ws, ["long"])
        assert done["long"]["finish_reason"] == "length"


async def test_disconnect_aborts_everything_of_the_connection(server):
    await wait_clean(server)
    before = server.stats()["total_output_tokens"]
    ws = await websockets.connect(server.ws_url)
    for cid in ("p", "q", "r"):
        await ws.send(chat(cid, 900))
    while (await recv(ws))["type"] != "delta":
        pass
    await ws.close()
    await wait_clean(server)
    assert server.stats()["total_output_tokens"] - before < 3 * 900


async def test_bad_frames_get_error_frames(server):
    async with websockets.connect(server.ws_url) as ws:
        await ws.send("{not json")
        f = await recv(ws)
        assert f["type"] == "error" and f["id"] is None and f["error"]["type"] == "invalid_request_error"
        await ws.send("[1, 2]")
        assert (await recv(ws))["type"] == "error"
        await ws.send(json.dumps({"type": "teleport", "id": 1}))
        f = await recv(ws)
        assert f["type"] == "error" and f["id"] == 1
        await ws.send(json.dumps({"type": "chat", "id": 2}))  # no messages
        f = await recv(ws)
        assert f["type"] == "error" and f["id"] == 2 and f["error"]["param"] == "messages"
        await ws.send(chat(3, 4, model="gpt-4o"))
        f = await recv(ws)
        assert f["type"] == "error" and f["error"]["code"] == "model_not_found"
        await ws.send(chat(4, 5000))
        f = await recv(ws)
        assert f["type"] == "error" and f["error"]["code"] == "context_length_exceeded"
        await ws.send(chat(5, 4, temperature=9))
        f = await recv(ws)
        assert f["type"] == "error" and f["error"]["param"] == "temperature"
        # a second chat with an id still generating is refused; the first one carries on
        await ws.send(chat("dup", 50))
        await ws.send(chat("dup", 50))
        frames = []
        while not frames or frames[-1]["type"] != "done":
            frames.append(await recv(ws))
        errors = [f for f in frames if f["type"] == "error"]
        assert len(errors) == 1 and errors[0]["id"] == "dup"
        assert frames[-1]["finish_reason"] == "length"
        await ws.send(json.dumps({"type": "ping", "id": "p"}))
        assert await recv(ws) == {"type": "pong", "id": "p"}
    await wait_clean(server)


async def test_ws_api_key(strict_server):
    import base64

    b64 = base64.urlsafe_b64encode(API_KEY.encode()).decode().rstrip("=")
    bad = base64.urlsafe_b64encode(b"wrong").decode().rstrip("=")
    refused = [{}, {"subprotocols": ["asyncengine.v1", "asyncengine.key." + bad]}]
    for kw in refused:
        with pytest.raises(websockets.exceptions.InvalidStatus):
            async with websockets.connect(strict_server.ws_url, **kw):
                pass
    # a key in the URL is never accepted (URLs end up in logs)
    with pytest.raises(websockets.exceptions.InvalidStatus):
        async with websockets.connect(strict_server.ws_url + f"?api_key={API_KEY}"):
            pass
    for kw in ({"subprotocols": ["asyncengine.v1", "asyncengine.key." + b64]},
               {"additional_headers": {"Authorization": f"Bearer {API_KEY}"}}):
        async with websockets.connect(strict_server.ws_url, **kw) as ws:
            if "subprotocols" in kw:
                assert ws.subprotocol == "asyncengine.v1"  # the key is never echoed back
            await ws.send(json.dumps({"type": "ping"}))
            assert (await recv(ws))["type"] == "pong"
