"""The ASGI app: OpenAI's /v1/completions and /v1/chat/completions (streaming or not), vLLM's
/tokenize and /detokenize, /v1/models,
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
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route, WebSocketRoute

from asyncengine.errors import AsyncEngineError

from . import openapi
from .errors import APIError, error_response, from_engine
from .lora_routes import ROUTES as LORA_ROUTES, add_adapter, adapter_cards, lora_routes
from .chat import chat_completions
from .completions import completions
from .connections import ConnectionCap
from .metrics import CONTENT_TYPE, HTTPMetricsMiddleware
from .responses_store import DEFAULT_SIZE, DEFAULT_TTL_S, ResponseStore
from .security import SecurityMiddleware, SecurityPolicy, install_log_redaction
from .sse import ClientGone
from .state import ServerState, json_response as _json, server_state as _state
from .embeddings import embeddings
from .rerank import ROUTES as SCORE_ROUTES, rerank, score
from .tokenize import detokenize, tokenize

log = logging.getLogger("asyncengine.integrations.openai_server")

ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                       "/openapi.json", "/", "/chat.js", "/v1/ws/chat", "/v1/responses", "/v1/messages",
                       "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/v1/embeddings", *LORA_ROUTES,
                       *SCORE_ROUTES})


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


def _model_card(st: ServerState) -> dict:
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "asyncengine",
            "max_model_len": st.max_model_len}


async def list_models(request: Request) -> Response:
    st = _state(request)
    return _json({"object": "list", "data": [_model_card(st), *adapter_cards(st, st.created)]})


async def get_model(request: Request) -> Response:
    st = _state(request)
    name = request.path_params["model"]
    if st.resolve_model(name) is not None:  # an adapter (an unknown name: 404)
        return _json(next(c for c in adapter_cards(st, st.created) if c["id"] == name))
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
    return _json(openapi.document(st.model_name, getattr(st.engine, "vocab_size", None),
                                  [lr.name for lr in st.engine.list_loras()]))


def _page(name: str, media_type: str):
    async def page(request: Request) -> Response:
        d = _state(request).web_chat_dir
        if d is None or not (d / name).is_file():
            raise APIError(404, "the web chat page is not installed")
        return FileResponse(d / name, media_type=media_type)

    return page


def other_api_routes() -> list[Route]:
    """The Responses API (responses.py) and Anthropic's Messages API (anthropic_messages.py)."""
    from .anthropic_messages import count_tokens, create_message  # lazy: route modules load when the app is built (start-up time)
    from .responses import create_response, delete_response, get_response  # lazy: route modules load when the app is built (start-up time)

    return [Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
            Route("/v1/messages", create_message, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]


# ---------------------------------------------------------------- errors, auth


async def _on_api_error(request, exc: APIError) -> Response:
    return error_response(exc, request.url.path)


async def _on_http_error(request, exc: HTTPException) -> Response:
    return error_response(APIError(exc.status_code, str(exc.detail)), request.url.path)


async def _on_client_gone(request, exc: ClientDisconnect) -> Response:
    return Response(status_code=499)  # nobody is there to read it


async def _on_engine_error(request, exc: AsyncEngineError) -> Response:
    return error_response(from_engine(exc, _state(request).engine), request.url.path)


async def _on_error(request, exc: Exception) -> Response:
    if isinstance(exc, RecursionError):  # belt and braces: check_json_depth runs before decoding
        return error_response(APIError(400, "the request is nested too deeply", code="limit_exceeded"),
                              request.url.path)
    ref = uuid.uuid4().hex[:12]
    log.error("unhandled error %s in %s %s: %s: %s", ref, request.method, request.url.path, type(exc).__name__,
              exc, exc_info=exc)
    # the client learns that it happened and how to find it in the log, never the traceback
    return error_response(APIError(500, f"internal error (reference {ref})", code="internal_error"),
                          request.url.path)


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
              ws_idle_timeout_s: float = 600.0, responses_store_size: int = DEFAULT_SIZE,
              responses_store_ttl_s: float = DEFAULT_TTL_S, chat_config=None, training_endpoints: bool = False,
              training_weights_dir: str | None = None, lora_modules=(), media_policy=None) -> Starlette:
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
    responses_store_size / responses_store_ttl_s: how many finished Responses-API responses are kept
        (for GET and ``previous_response_id``), and for how long (responses_store.py).
    chat_config: how chat outputs are read (chat_render.ChatConfig: tool-call and reasoning parsers,
        default chat_template_kwargs; default: the project's JSON-array tool calls, no reasoning parser).
    training_endpoints: serve /pause, /resume, /sleep, /wake_up, /reset_prefix_cache and
        /update_weights (training.py; needs ``api_key``); ``training_weights_dir``: where
        /update_weights may read checkpoints.
    lora_modules: (name, path) LoRA adapters registered at start (``--lora-modules``; a bad one stops
        the start); with ``enable_lora`` the app serves /v1/load_lora_adapter too (lora_routes.py).
    media_policy: which image URLs beyond data: URLs chat requests may name (media.py; default none).
    Request limits are the engine's (``EngineConfig.limits``).
    """
    from .websocket import ws_chat  # lazy: route modules load when the app is built (start-up time)

    name = served_model_name or getattr(getattr(engine, "config", None), "model", None)
    if not name:
        from asyncengine.models.default_model import DEFAULT_MODEL  # lazy: the engine and its model code load only when serving starts

        name = DEFAULT_MODEL
    policy = SecurityPolicy(api_key, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins,
                            bind_host=bind_host, metrics_public=metrics_public)
    st = ServerState(engine, str(name), policy,
                     Path(web_chat_dir) if web_chat_dir is not None else find_web_chat_dir(), chat_config)
    st.responses = ResponseStore(responses_store_size, responses_store_ttl_s)
    if media_policy is not None:  # image URLs chat requests may name (media.py: MediaPolicy)
        st.media = media_policy
    install_log_redaction()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await engine.start()  # bind the engine to the server's loop
        for lora_name, lora_path in lora_modules:
            await add_adapter(engine, lora_name, lora_path)
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
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/score", score, methods=["POST"]),
        Route("/v1/rerank", rerank, methods=["POST"]),
        Route("/v2/rerank", rerank, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/", _page("index.html", "text/html; charset=utf-8"), methods=["GET"]),
        Route("/chat", _page("index.html", "text/html; charset=utf-8"), methods=["GET"]),
        Route("/chat.js", _page("chat.js", "text/javascript; charset=utf-8"), methods=["GET"]),
        WebSocketRoute("/v1/ws/chat", ws_chat),
        *other_api_routes(),
    ]
    if training_endpoints:  # off by default; they change what every client is served
        from .training import training_routes  # lazy: route modules load when the app is built (start-up time)

        if not api_key:
            raise ValueError("the training endpoints need an API key (--api-key or $ASYNCENGINE_API_KEY)")
        routes += training_routes(engine, training_weights_dir)
    if getattr(getattr(engine, "config", None), "enable_lora", False):
        routes += lora_routes()
    middleware = [Middleware(HTTPMetricsMiddleware, metrics=st.metrics, endpoints=ENDPOINTS)]
    if allowed_origins:  # CORS only where asked for (a preflight is answered before the key check)
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                                     allow_methods=["GET", "POST", "DELETE"],
                                     allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"]))
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
