"""The ASGI app: OpenAI's /v1/completions and /v1/chat/completions (streaming or not), /v1/models,
/health, /metrics, /openapi.json, a websocket chat at /v1/ws/chat and the web chat page at /.

``build_app(engine, served_model_name=..., api_key=None)`` embeds it around any AsyncLLMEngine; the
app binds the engine to the server's event loop when it starts.

Hostile input: every body is bounded before it is read (``RequestLimits.max_request_bytes``: 413),
its JSON nesting before it is decoded, and every field by the engine's own validation module
(``asyncengine/engine/validation.py``: the same rules as in-process), so a request's cost is known
before any work; Host, Origin, Content-Type and the API key are checked first (security.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from pathlib import Path

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route, WebSocketRoute

from asyncengine.errors import AsyncEngineError

from . import guided, openapi
from .errors import APIError, error_response, from_engine
from .generation import Submission, chat_logprobs, completion_logprobs, merge_streams, sampling_params
from .metrics import CONTENT_TYPE, HTTPMetricsMiddleware
from .protocol import ChatCompletionRequest, CompletionRequest
from .connections import ConnectionCap
from .security import SecurityMiddleware, SecurityPolicy, install_log_redaction
from .sse import SSE_DONE, ClientGone, SSEResponse, run_until_disconnect, sse_event
from .state import ServerState
from .tools import ToolPlan

log = logging.getLogger("asyncengine.integrations.openai_server")

ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                       "/openapi.json", "/", "/chat.js", "/v1/ws/chat"})


def _json(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, headers=headers, media_type="application/json")


def find_web_chat_dir() -> Path | None:
    """The web chat page: installed as package data (asyncengine.integrations.web_chat, a data-only
    package), or examples/web_chat/ of a source checkout."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("asyncengine.integrations.web_chat")
    except ImportError:
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(loc) / "index.html").is_file():
            return Path(loc)
    p = Path(__file__).resolve().parents[2] / "examples" / "web_chat"
    return p if (p / "index.html").is_file() else None


# ---------------------------------------------------------------- endpoints


def _state(request) -> ServerState:
    return request.app.state.server


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _check_samples(st: ServerState, num_prompts: int, n: int) -> None:
    if num_prompts * n > st.limits.max_samples:
        raise APIError(400, f"prompts x n is {num_prompts * n}, over the limit max_samples={st.limits.max_samples}",
                       param="n", code="limit_exceeded")


async def completions(request: Request) -> Response:
    st = _state(request)
    req: CompletionRequest = await st.read_json(request, CompletionRequest)
    st.check_model(req.model)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (only best_of == n)", param="best_of")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported", param="echo")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    _check_samples(st, len(req.prompt) if isinstance(req.prompt, list) and req.prompt
                   and not isinstance(req.prompt[0], (int, float)) else 1, req.n)
    k = req.logprobs
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=k, stream=bool(req.stream),
                             limits=st.limits,
                             defaults=st.engine.default_sampling_params)
    st.check_params(params, req.n)  # before any prompt is tokenized
    so, field = guided.requested(req)
    prompts = await st.completion_prompts(req.prompt)
    for _, ids in prompts:
        st.check_length(len(ids), req.max_tokens, "prompt")
    params = await run_until_disconnect(request, st.constrain(params, None, so, False, field))
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = await st.submit(prompts, params, req.n, rid)
    n = req.n
    created = int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": st.model_name}
    echo_texts = []
    if req.echo:
        tok = st.engine.tokenizer
        echo_texts = [text if text is not None else (tok.decode(ids) if tok is not None else "")
                      for text, ids in prompts]
    prompt_tokens = sum(len(ids) for _, ids in prompts)

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        offsets = [0] * len(streams)

        def choice(i: int, out, c) -> dict | None:
            lp = None
            if k is not None:
                lp, offsets[i] = completion_logprobs(c.logprobs, k, offsets[i])
            if not (c.text or out.finished or (lp is not None and lp["tokens"])):
                return None
            return {"index": i, "text": c.text, "logprobs": lp}

        first = [{"index": i * n + j, "text": text, "logprobs": None, "finish_reason": None}
                 for i, text in enumerate(echo_texts) for j in range(n)]
        return SSEResponse(_sse_events(st, head, streams, prompt_tokens, include_usage, first, choice))

    try:
        finals = await _collect_finals(request, st, streams)
    except ClientGone:
        return Response(status_code=499)
    choices = []
    completion_tokens = 0
    for i, out in enumerate(finals):
        c = out.outputs[0]
        completion_tokens += len(c.token_ids)
        st.metrics.observe(out, len(c.token_ids))
        text = (echo_texts[i // n] + c.text) if req.echo else c.text
        choices.append({"index": i, "text": text,
                        "logprobs": completion_logprobs(c.logprobs, k, 0)[0] if k is not None else None,
                        "finish_reason": out.finish_reason, "stop_reason": c.stop_reason})
    return _json({**head, "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)})


async def _sse_events(st, head: dict, streams: Submission, prompt_tokens: int, include_usage: bool,
                      first_choices: list[dict], choice):
    """The SSE stream of a completion or chat request: ``first_choices`` (each in its own event),
    then one event per output that ``choice(i, out, c)`` turns into a choice dict (None = nothing to
    send), the usage if asked for, and ``[DONE]``. Engine errors become an error event."""
    counts = [0] * len(streams)
    finished = set()
    try:
        for c0 in first_choices:
            yield sse_event({**head, "choices": [c0]})
        async for i, out in merge_streams(streams):
            c = out.outputs[0]
            counts[i] += len(c.token_ids)
            ch = choice(i, out, c)
            if ch is not None:
                ch["finish_reason"] = out.finish_reason if out.finished else None
                if out.finished:
                    ch["stop_reason"] = c.stop_reason
                yield sse_event({**head, "choices": [ch]})
            if out.finished:
                finished.add(i)
                st.metrics.observe(out, counts[i])
        if include_usage:
            yield sse_event({**head, "choices": [], "usage": _usage(prompt_tokens, sum(counts))})
    except (AsyncEngineError, APIError) as e:
        yield sse_event(from_engine(e, st.engine).body())
    finally:
        if len(finished) < len(streams):
            st.metrics.finished.labels("abort").inc(len(streams) - len(finished))
    yield SSE_DONE


async def _collect_finals(request: Request, st, streams: Submission) -> list:
    """Every choice's final output (non-streaming). If the client leaves first, the requests are
    aborted, counted, and ClientGone propagates."""
    finals: list = [None] * len(streams)

    async def collect():
        async for i, out in merge_streams(streams):
            finals[i] = out

    try:
        await run_until_disconnect(request, collect())
    except ClientGone:
        st.metrics.finished.labels("abort").inc(sum(f is None for f in finals))
        raise
    except AsyncEngineError as e:
        raise from_engine(e, st.engine) from None
    return finals


async def chat_completions(request: Request) -> Response:
    st = _state(request)
    req: ChatCompletionRequest = await st.read_json(request, ChatCompletionRequest)
    st.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens=max_tokens, logprobs=k, stream=bool(req.stream), limits=st.limits,
                             defaults=st.engine.default_sampling_params)
    st.check_params(params, req.n)  # before the messages are rendered
    plan = ToolPlan(req.tools, req.tool_choice, req.parallel_tool_calls)
    ids = await st.chat_prompt(req.messages, plan.prompt())  # the tools described in a system message
    st.check_length(len(ids), max_tokens, "messages")
    so, field = guided.requested(req)
    # compiled while watching the client: one that leaves cancels its compile (the worker is killed)
    params = await run_until_disconnect(request, st.constrain(
        params, plan.structured(), so, bool(req.stream) and plan.mode in ("required", "named"), field))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await st.submit([(None, ids)], params, req.n, rid)
    created = int(time.time())
    head = {"id": rid, "object": "chat.completion", "created": created, "model": st.model_name}

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        head["object"] = "chat.completion.chunk"

        def choice(i: int, out, c) -> dict | None:
            lp = {"content": chat_logprobs(c.logprobs, k, st.token_bytes)} if k is not None else None
            if not (c.text or out.finished or (lp is not None and lp["content"])):
                return None
            return {"index": i, "delta": {"content": c.text} if c.text else {}, "logprobs": lp}

        first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(len(streams))]
        return SSEResponse(_sse_events(st, head, streams, len(ids), include_usage, first, choice))

    try:
        finals = await _collect_finals(request, st, streams)
    except ClientGone:
        return Response(status_code=499)
    choices = []
    completion_tokens = 0
    for i, out in enumerate(finals):
        c = out.outputs[0]
        completion_tokens += len(c.token_ids)
        st.metrics.observe(out, len(c.token_ids))
        calls = plan.tool_calls(c.text) if plan.mode != "none" else None
        message = {"role": "assistant", "content": c.text}
        if calls:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
        choices.append({"index": i, "message": message,
                        "logprobs": {"content": chat_logprobs(c.logprobs, k, st.token_bytes)} if k is not None else None,
                        "finish_reason": "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason,
                        "stop_reason": c.stop_reason})
    return _json({**head, "choices": choices, "usage": _usage(len(ids), completion_tokens)})


def _model_card(st: ServerState) -> dict:
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "asyncengine",
            "max_model_len": st.max_model_len}


async def list_models(request: Request) -> Response:
    return _json({"object": "list", "data": [_model_card(_state(request))]})


async def get_model(request: Request) -> Response:
    st = _state(request)
    name = request.path_params["model"]
    st.check_model(name)
    return _json(_model_card(st))


async def health(request: Request) -> Response:
    st = _state(request)
    engine = st.engine
    if getattr(engine, "errored", False):  # a model/executor fault: this server cannot serve any more
        return _json({"status": "error", "message": "the engine died"}, status=503)
    if st.shutting_down or getattr(engine, "is_closing", False):
        return _json({"status": "shutting_down"}, status=503)
    alive, cores = engine.cores_alive() if hasattr(engine, "cores_alive") else (1, 1)  # data parallel
    if alive < cores:
        # still serving on the cores left: 200, so that a load balancer keeps sending
        return _json({"status": "degraded", "cores_alive": alive, "cores": cores})
    return _json({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def openapi_json(request: Request) -> Response:
    st = _state(request)
    return _json(openapi.document(st.model_name, getattr(st.engine, "vocab_size", None)))


def _page(name: str, media_type: str):
    async def page(request: Request) -> Response:
        d = _state(request).web_chat_dir
        if d is None or not (d / name).is_file():
            raise APIError(404, "the web chat page is not installed")
        return FileResponse(d / name, media_type=media_type)

    return page


# ---------------------------------------------------------------- errors, auth


async def _on_api_error(request, exc: APIError) -> Response:
    return error_response(exc)


async def _on_http_error(request, exc: HTTPException) -> Response:
    return error_response(APIError(exc.status_code, str(exc.detail)))


async def _on_client_gone(request, exc: ClientDisconnect) -> Response:
    return Response(status_code=499)  # nobody is there to read it


async def _on_engine_error(request, exc: AsyncEngineError) -> Response:
    return error_response(from_engine(exc, _state(request).engine))


async def _on_error(request, exc: Exception) -> Response:
    if isinstance(exc, RecursionError):  # belt and braces: check_json_depth runs before decoding
        return error_response(APIError(400, "the request is nested too deeply", code="limit_exceeded"))
    ref = uuid.uuid4().hex[:12]
    log.error("unhandled error %s in %s %s: %s: %s", ref, request.method, request.url.path, type(exc).__name__,
              exc, exc_info=exc)
    # the client learns that it happened and how to find it in the log, never the traceback
    return error_response(APIError(500, f"internal error (reference {ref})", code="internal_error"))


# ---------------------------------------------------------------- the app


ENGINE_DEAD_GRACE_S = 1.0


async def _watch_engine(engine, on_dead) -> None:
    """Call ``on_dead()`` once the engine has died (and the grace has passed)."""
    while not getattr(engine, "errored", False):
        await asyncio.sleep(0.25)
    log.error("the engine is dead: answering 503 for %.0f s, then stopping", ENGINE_DEAD_GRACE_S)
    await asyncio.sleep(ENGINE_DEAD_GRACE_S)
    on_dead()


def build_app(engine, served_model_name: str | None = None, api_key: str | None = None, *,
              own_engine: bool = False, web_chat_dir: str | os.PathLike | None = None,
              allowed_hosts=None, allowed_origins=(), bind_host: str = "127.0.0.1",
              metrics_public: bool = False, on_engine_dead=None, max_connections: int = 512,
              ws_idle_timeout_s: float = 600.0) -> Starlette:
    """The OpenAI-compatible ASGI app around ``engine`` (an AsyncLLMEngine).

    served_model_name: the ``model`` clients must name (default: the engine's model).
    api_key: require ``Authorization: Bearer <api_key>`` on everything but /health and the chat page
        (/metrics too unless ``metrics_public``).
    own_engine: shut the engine down when the app stops (what ``serve`` does).
    web_chat_dir: where the web chat page lives (default: the installed page).
    allowed_hosts: Host names accepted besides the defaults for ``bind_host`` (security.py; "*": all).
    allowed_origins: browser origins besides the server's own that may post and open websockets;
        they also get CORS headers (CORS is off without them; "*": every origin).
    on_engine_dead(): called once, ``ENGINE_DEAD_GRACE_S`` after the engine died (its clients have
        had their errors; later ones get 503s meanwhile): ``serve`` stops the server there and exits
        non-zero, so that a supervisor restarts it.
    max_connections: websockets plus in-flight /v1/ requests at once; more get 503 (connections.py).
    ws_idle_timeout_s: a websocket with no frame and no generation for this long is closed (1001).
    Request limits are the engine's (``EngineConfig.limits``).
    """
    from .websocket import ws_chat

    name = served_model_name or getattr(getattr(engine, "config", None), "model", None)
    if not name:
        from asyncengine.models.default_model import DEFAULT_MODEL

        name = DEFAULT_MODEL
    policy = SecurityPolicy(api_key, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins,
                            bind_host=bind_host, metrics_public=metrics_public)
    st = ServerState(engine, str(name), policy,
                     Path(web_chat_dir) if web_chat_dir is not None else find_web_chat_dir())
    install_log_redaction()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await engine.start()  # bind the engine to the server's loop
        st.loop = asyncio.get_running_loop()
        watcher = asyncio.ensure_future(_watch_engine(engine, on_engine_dead)) if on_engine_dead else None
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            st.shutting_down = True
            if own_engine:
                await engine.shutdown(drain=False)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/", _page("index.html", "text/html; charset=utf-8"), methods=["GET"]),
        Route("/chat", _page("index.html", "text/html; charset=utf-8"), methods=["GET"]),
        Route("/chat.js", _page("chat.js", "text/javascript; charset=utf-8"), methods=["GET"]),
        WebSocketRoute("/v1/ws/chat", ws_chat),
    ]
    middleware = [Middleware(HTTPMetricsMiddleware, metrics=st.metrics, endpoints=ENDPOINTS)]
    if allowed_origins:  # CORS only where asked for (a preflight is answered before the key check)
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type"]))
    middleware.append(Middleware(SecurityMiddleware, policy=policy))
    middleware.append(Middleware(ConnectionCap, limit=max_connections))  # after the key check
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={APIError: _on_api_error, AsyncEngineError: _on_engine_error, HTTPException: _on_http_error,
                            ClientDisconnect: _on_client_gone, ClientGone: _on_client_gone,
                            Exception: _on_error},
        lifespan=lifespan)
    app.state.server = st
    st.ws_idle_timeout_s = ws_idle_timeout_s
    app.state.engine = engine
    return app
