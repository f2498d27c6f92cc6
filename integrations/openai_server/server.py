"""``serve()``: load a model and run the app under uvicorn (uvloop when installed). What
``asyncengine serve`` calls."""
from __future__ import annotations

import importlib.util
import os


def serve(model: str | None = None, host: str = "127.0.0.1", port: int = 8000, dtype: str = "auto",
          api_key: str | None = None, max_model_len: int | None = None, seed: int = 0, *,
          served_model_name: str | None = None, log_level: str = "info", allowed_hosts=None,
          allowed_origins=(), metrics_public: bool = False, on_loaded=None, warm_up: bool = True,
          max_connections: int = 512, ws_idle_timeout_s: float = 600.0, responses_store_size: int = 1024,
          responses_store_ttl_s: float = 3600.0, chat_config=None, training_endpoints: bool = False,
          training_weights_dir: str | None = None, engine_config=None, lora_modules=(), media_policy=None,
          **engine_kwargs) -> int:
    """Serve ``model`` (a name, HF folder or .gguf; None = the default model) until interrupted.

    api_key: require ``Authorization: Bearer <key>`` on everything but /health and the chat page
    (default: $ASYNCENGINE_API_KEY). allowed_hosts / allowed_origins / metrics_public: see
    build_app (security.py). chat_config: how chat outputs are read (chat_render.ChatConfig: the
    tool-call and reasoning parsers). warm_up: run one short request on the server's loop before it
    listens, so the first client does not pay the first step's one-time costs
    (asyncengine/engine/warmup.py). on_loaded(engine): called once the model is loaded and warmed
    up, before the server listens. responses_store_size / responses_store_ttl_s: the Responses API's
    store (build_app). training_endpoints / training_weights_dir: see build_app (training.py).
    lora_modules: (name, path) LoRA adapters served by name from the start (needs enable_lora).
    media_policy: the image URLs chat requests may name beyond data: URLs (media.py: MediaPolicy).
    Other keyword arguments go to EngineConfig (``limits=RequestLimits(...)`` bounds what
    one request may cost; ``prefill_cores``/``decode_cores`` serve through a PDEngine,
    engine/pd_client.py); or ``engine_config``: an EngineConfig already built (the CLI's), used as
    is, with no model/dtype/max_model_len/seed/keyword arguments beside it. Returns the exit status: 0, or 1 when it stopped because the engine died
    (after answering in-flight clients; a supervisor restarts it)."""
    import uvicorn

    from asyncengine import AsyncLLMEngine, EngineConfig  # lazy: the engine and its model code load only when serving starts
    from asyncengine.models.default_model import DEFAULT_MODEL  # lazy: the engine and its model code load only when serving starts

    from .app import build_app  # lazy: the engine and its model code load only when serving starts

    if api_key is None:
        api_key = os.environ.get("ASYNCENGINE_API_KEY") or None
    if training_endpoints and not api_key:
        raise ValueError("--enable-training-endpoints needs an API key (--api-key or $ASYNCENGINE_API_KEY)")
    if engine_config is None:
        config = EngineConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, **engine_kwargs)
    elif engine_kwargs or model is not None or (dtype, max_model_len, seed) != ("auto", None, 0):
        raise TypeError("serve(): give engine_config or the EngineConfig keyword arguments, not both")
    else:
        config, model = engine_config, engine_config.model
    engine = AsyncLLMEngine.from_config(config)  # a PDEngine for prefill_cores/decode_cores
    server: uvicorn.Server | None = None

    def stop() -> None:
        server.should_exit = True

    app = build_app(engine, served_model_name=served_model_name or model or DEFAULT_MODEL, api_key=api_key,
                    own_engine=True, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins,
                    bind_host=host, metrics_public=metrics_public, on_engine_dead=stop,
                    max_connections=max_connections, ws_idle_timeout_s=ws_idle_timeout_s,
                    responses_store_size=responses_store_size, responses_store_ttl_s=responses_store_ttl_s,
                    chat_config=chat_config, training_endpoints=training_endpoints, media_policy=media_policy,
                    training_weights_dir=training_weights_dir, lora_modules=lora_modules)
    _before_listening(app, engine, warm_up, on_loaded)
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, loop=loop, log_level=log_level,
                                           timeout_graceful_shutdown=5, ws_max_size=engine.limits.max_request_bytes))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled (as uvicorn.run swallows it)
        pass
    return 1 if engine.errored else 0


def _before_listening(app, engine, warm_up: bool, on_loaded) -> None:
    """Warm the engine up and call ``on_loaded(engine)`` inside the app's start-up (lifespan), on
    the loop the server runs: uvicorn opens its socket only after it."""
    import contextlib

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            if warm_up:
                from asyncengine.engine.warmup import warm_up as run_warm_up  # lazy: only when the server warms up

                await run_warm_up(engine)
            if on_loaded is not None:
                on_loaded(engine)
            yield state

    app.router.lifespan_context = lifespan
