"""The ``serve`` command: check what can fail in a second (the server's extras installed, the
port free) before the model loads for seconds, turn the flags into the server's limits, and start
the OpenAI-compatible server with a status line until it listens. The server and its web stack are
imported only when it starts.
"""
from __future__ import annotations

import os
import socket
import sys

from asyncengine.cli.args import EXIT_USAGE, engine_config_of, model_problem, warm_up_wanted
from asyncengine.cli.chat_options import chat_config
from asyncengine.cli.status import LoadStatus


def _check_port(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port, checked before the model loads; None if it can."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot resolve --host {host!r}: {e}"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return f"cannot listen on {host}:{port}: {e.strerror or e}" + \
                (" (is another server running there? pick another --port)" if e.errno in (98, 48) else "")
    return None


def run_serve(args) -> int:
    import importlib.util

    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"asyncengine: `serve` needs {', '.join(missing)}: reinstall asyncengine (pip install asyncengine)", file=sys.stderr)
        return EXIT_USAGE
    if args.enable_training_endpoints and not (args.api_key or os.environ.get("ASYNCENGINE_API_KEY")):
        print("asyncengine: --enable-training-endpoints needs --api-key (or $ASYNCENGINE_API_KEY)", file=sys.stderr)
        return EXIT_USAGE
    if args.lora_modules and not args.enable_lora:
        print("asyncengine: --lora-modules needs --enable-lora", file=sys.stderr)
        return EXIT_USAGE
    if (why := _check_port(args.host, args.port)) is not None:
        print(f"asyncengine: {why}", file=sys.stderr)
        return EXIT_USAGE
    if args.responses_store_size < 0:
        print("asyncengine: --responses-store-size must be >= 0 (0: keep no response)", file=sys.stderr)
        return EXIT_USAGE
    if (why := model_problem(args.model)) is not None:
        print(f"asyncengine serve: error: {why} (see `asyncengine serve --help`)", file=sys.stderr)
        return EXIT_USAGE
    from asyncengine.integrations.openai_server import serve  # lazy: the web stack only when serving

    # built once, by the flags' check (cli/__init__.py), else here: bad values fail before the model loads
    config = getattr(args, "engine_config", None) or engine_config_of(args)
    try:
        chat = chat_config(args)
    except ValueError as e:
        print(f"asyncengine: {e}", file=sys.stderr)
        return EXIT_USAGE
    status = LoadStatus(args.model or "smollm2-135m-instruct")

    def status_warm(engine) -> None:
        core = getattr(engine, "client", None)  # the P/D front end compiles in its decode engines
        if core is not None and engine.tokenizer is not None and importlib.util.find_spec("xgrammar") is not None:
            # the grammar compile workers start before the server listens, not at its first
            # structured request (~55 MB, ~0.3-2 s; structured/compile_service.py)
            from asyncengine.structured.compile_service import warm_up  # lazy: the server's modules only when serving

            status.step("starting the grammar compiler")
            warm_up(engine.config, core)
        status.done(f"ready, {engine.kernels}, serving on http://{args.host}:{args.port}")

    try:
        return serve(host=args.host, port=args.port, engine_config=config,
                     api_key=args.api_key or os.environ.get("ASYNCENGINE_API_KEY"),
                     allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
                     metrics_public=args.metrics_public,
                     max_connections=args.max_connections, ws_idle_timeout_s=args.ws_idle_timeout,
                     responses_store_size=args.responses_store_size,
                     responses_store_ttl_s=args.responses_store_ttl,
                     training_endpoints=args.enable_training_endpoints,
                     training_weights_dir=args.training_weights_dir, on_loaded=status_warm,
                     lora_modules=args.lora_modules, warm_up=warm_up_wanted(args), chat_config=chat,
                     media_policy=media_policy(args))
    except BaseException:
        status.done("stopped")
        raise


def media_policy(args):
    """--allowed-media-domains / --allowed-local-media-path as the server's MediaPolicy."""
    from asyncengine.integrations.openai_server.media import MediaPolicy  # lazy: the server's modules only when serving

    return MediaPolicy(allowed_domains=tuple(d.lower() for d in args.allowed_media_domains),
                       allowed_local_path=args.allowed_local_media_path)
