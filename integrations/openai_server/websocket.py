"""Chat over one websocket, several conversations at once (JSON text frames).

Client -> server:
    {"type": "chat", "id": ID, "messages": [{"role": ..., "content": ...}, ...],
     + optional max_tokens / max_completion_tokens, temperature, top_p, top_k, stop, seed,
       presence_penalty, frequency_penalty, ignore_eos, response_format (or vLLM's
       structured_outputs / guided_* fields), chat_template_kwargs, ...}
                                                                   start a generation
    {"type": "cancel", "id": ID}                                   stop it (an unknown id is ignored:
                                                                   it may have just finished)
    {"type": "ping"}                                               -> {"type": "pong"}
Server -> client:
    {"type": "reasoning", "id": ID, "text": "..."}                 the reasoning span, apart (only with
                                                                   serve --reasoning-parser)
    {"type": "delta", "id": ID, "text": "..."}                     any number, in order per id
    {"type": "done", "id": ID, "finish_reason": "stop"|"length"|"abort",
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}
    {"type": "error", "id": ID or null, "error": {"message", "type", "param", "code"}}

A content may be a list of parts with ``image_url`` ones, as /v1/chat/completions takes them (media.py).
ID is any string or number the client picks (the server picks one when it is missing and echoes
it). Frames of different ids interleave. A cancelled generation ends with a "done" frame whose
finish_reason is "abort"; when the client disconnects, every generation of the connection is
aborted at once (its KV blocks are freed). When the engine dies, every generation gets an "error"
frame (code "engine_dead") and then the server closes the connection (code 1011): nothing on it
can work any more. A connection idle at that moment gets the same at its next chat frame.
A connection with no frame from the client and no generation running for ``ws_idle_timeout_s``
(build_app; ``serve --ws-idle-timeout``) is closed with code 1001 ("idle timeout"); open
connections are capped (connections.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from asyncengine.config import request_limits
from asyncengine.errors import AsyncEngineError

from . import guided, media
from .chat import ChatPlan
from .errors import APIError, from_engine
from .generation import sampling_params, submit_n
from .protocol import WSCancel, WSChat, WSFrame, WSPing, convert
from .security import WS_PROTOCOL, ws_protocols

log = logging.getLogger("asyncengine.integrations.openai_server")

MAX_CONVERSATIONS = 32  # at once, per connection


class _Connection:
    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self.st = ws.app.state.server
        self.lock = asyncio.Lock()  # one frame at a time on the wire
        self.tasks: dict[object, asyncio.Task] = {}
        self.request_ids: dict[object, str] = {}
        self._ids = itertools.count()
        self.engine_dead = False  # once set, the connection closes when its last generation ended

    async def send(self, obj) -> None:
        data = msgspec.json.encode(obj).decode("utf-8")
        async with self.lock:
            await self.ws.send_text(data)

    async def send_error(self, cid, e: APIError) -> None:
        await self.send({"type": "error", "id": cid, **e.body()})
        if e.code == "engine_dead":
            self.engine_dead = True

    async def close_if_engine_dead(self) -> None:
        """After the engine died, once every generation has had its error frame: close (1011)."""
        if self.engine_dead and not self.tasks:
            with contextlib.suppress(Exception):
                await self.ws.close(code=1011, reason="the engine died")

    async def handle(self, raw: str | bytes) -> None:
        limits = self.st.limits
        data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
        try:
            request_limits.check_body_size(len(data), limits)
            if len(data) > 256 * 1024:  # megabytes: scanned off the event loop
                await asyncio.to_thread(request_limits.check_json_depth, data, limits)
            else:
                request_limits.check_json_depth(data, limits)
        except request_limits.RequestLimitError as e:
            return await self.send_error(None, APIError(400, str(e), param="frame", code="limit_exceeded"))
        try:
            obj = msgspec.json.decode(data)
        except msgspec.DecodeError as e:
            return await self.send_error(None, APIError(400, f"a frame must be a JSON object: {e}"))
        if not isinstance(obj, dict):
            return await self.send_error(None, APIError(400, "a frame must be a JSON object"))
        cid = obj.get("id")
        if cid is not None and (isinstance(cid, bool) or not isinstance(cid, (str, int))):
            return await self.send_error(None, APIError(400, "id must be a string or a number", param="id"))
        try:
            frame = convert(obj, WSFrame)
        except APIError as e:
            return await self.send_error(cid, e)
        if isinstance(frame, WSPing):
            return await self.send({"type": "pong", "id": cid})
        if isinstance(frame, WSCancel):
            rid = self.request_ids.get(cid)
            if rid is not None:
                await self.st.engine.abort(rid)  # its stream ends with finish_reason "abort"
            return
        assert isinstance(frame, WSChat)
        if cid is None:
            cid = f"chat-{next(self._ids)}"
        if cid in self.tasks:
            return await self.send_error(cid, APIError(400, f"id {cid!r} is already generating", param="id"))
        if len(self.tasks) >= MAX_CONVERSATIONS:
            return await self.send_error(cid, APIError(
                429, f"at most {MAX_CONVERSATIONS} generations at once per connection", code="too_many_generations"))
        # prepared and submitted before the next frame is read, so a cancel right behind it finds it
        try:
            stream, parser = await self._submit(cid, frame)
        except APIError as e:
            await self.send_error(cid, e)
            return await self.close_if_engine_dead()
        self.tasks[cid] = asyncio.create_task(self._run(cid, stream, parser))

    async def _submit(self, cid, frame: WSChat):
        st = self.st
        lora = st.resolve_model(frame.model)
        max_tokens = frame.max_completion_tokens if frame.max_completion_tokens is not None else frame.max_tokens
        params = sampling_params(frame, max_tokens=max_tokens, logprobs=None, stream=True, limits=st.limits)
        st.check_params(params, 1)
        so, _ = guided.requested(frame)  # response_format or vLLM's fields: checked now, compiled by
        if so is not None:               # the engine off this loop (errors come as this id's error frame)
            params = msgspec.structs.replace(params, structured_outputs=so)
        plan = ChatPlan(st, frame)  # chat_template_kwargs, the reasoning parser (no tools on this endpoint)
        messages, image_urls = media.split_images(frame.messages, st.engine)  # image parts: the image token
        ids = await plan.prompt(st, messages)
        params = plan.reasoning_gate(st, params)  # a grammar starts after the reasoning span
        prompt: dict = {"prompt_token_ids": ids}
        if image_urls:  # as /v1/chat/completions takes them (media.py); decoded and checked by the engine
            mm = media.processor_of(st.engine)
            prompt["multi_modal_data"] = {"image": await media.load_sources(image_urls, st.media, mm.limits.max_bytes)}
        st.check_length(len(ids) + len(image_urls) * (mm.tokens_per_image - 1 if image_urls else 0), max_tokens,
                        "messages")
        rid = f"ws-{uuid.uuid4().hex}"
        try:
            stream = submit_n(st.engine, prompt, params, 1, rid, lora)
        except AsyncEngineError as e:
            raise from_engine(e, st.engine) from None
        self.request_ids[cid] = stream.request_id
        return stream, plan.parser()

    async def _send_parsed(self, cid, d) -> None:
        if d.reasoning:
            await self.send({"type": "reasoning", "id": cid, "text": d.reasoning})
        if d.content:
            await self.send({"type": "delta", "id": cid, "text": d.content})

    async def _run(self, cid, stream, parser) -> None:
        st = self.st
        n = 0
        finished = False
        try:
            async for out in stream:
                n += len(out.token_ids_delta)
                if out.text_delta:
                    await self._send_parsed(cid, parser.feed(out.text_delta))
                if out.finished:
                    await self._send_parsed(cid, parser.finish())
                    finished = True
                    st.metrics.observe(out, n)
                    prompt = len(out.prompt_token_ids)
                    await self.send({"type": "done", "id": cid, "finish_reason": out.finish_reason,
                                     "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                                               "total_tokens": prompt + n}})
        except AsyncEngineError as e:
            with contextlib.suppress(Exception):
                await self.send_error(cid, from_engine(e, st.engine))
        except (WebSocketDisconnect, RuntimeError, OSError):  # the client left while we sent
            pass
        except Exception:
            log.exception("websocket generation %r failed", cid)
        finally:
            await stream.aclose()  # aborts it if it did not finish
            if not finished:
                st.metrics.finished.labels("abort").inc()
            self.tasks.pop(cid, None)
            self.request_ids.pop(cid, None)
            await self.close_if_engine_dead()

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()  # cancelling the consumer aborts the request in the engine
        await asyncio.gather(*tasks, return_exceptions=True)


async def ws_chat(ws: WebSocket) -> None:
    # the web page offers asyncengine.v1 (plus its key as a second subprotocol, see security.py):
    # a browser drops a connection whose server picks none of the offered ones
    offered = ws_protocols(dict(ws.scope.get("headers", ())))
    await ws.accept(subprotocol=WS_PROTOCOL if WS_PROTOCOL in offered else None)
    conn = _Connection(ws)
    idle_s = getattr(conn.st, "ws_idle_timeout_s", None)
    try:
        while True:
            try:
                msg = await asyncio.wait_for(ws.receive(), idle_s)
            except asyncio.TimeoutError:
                if conn.tasks:  # generating: not idle
                    continue
                await ws.close(code=1001, reason="idle timeout")
                break
            if msg["type"] == "websocket.disconnect":
                break
            data = msg.get("text")
            if data is None:
                data = msg.get("bytes")
            if data is None:
                continue
            await conn.handle(data)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
    finally:
        await conn.close()
