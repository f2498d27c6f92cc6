"""The ``serve`` command: check what can fail in a second (the server's extras installed, the
port free) before the model loads for seconds, turn the flags into the server's limits, and start
the OpenAI-compatible server with a status line until it listens. The server and its web stack are
imported only when it starts.
"""
from __future__ import annotations

import os
import socket
import sys

from asyncengine.cli.args import EXIT_USAGE, parse_size
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
        print(f"asyncengine: `serve` needs {', '.join(missing)}: pip install 'asyncengine[serve]'", file=sys.stderr)
        return EXIT_USAGE
    if (why := _check_port(args.host, args.port)) is not None:
        print(f"asyncengine: {why}", file=sys.stderr)
        return EXIT_USAGE
    from asyncengine.engine.validation import RequestLimits
    from asyncengine.integrations.openai_server import serve

    limits = {k: v for k, v in (("max_request_bytes", args.max_request_bytes),
                                ("max_prompt_chars", args.max_prompt_chars),
                                ("max_stop_strings", args.max_stop_strings),
                                ("max_stop_string_chars", args.max_stop_string_chars),
                                ("max_n", args.max_n)) if v is not None}
    kw = {k: v for k, v in (("max_queued_requests", args.max_queued_requests),
                            ("max_queued_tokens", args.max_queued_tokens)) if v is not None}
    kw["max_num_seqs"] = args.max_num_seqs or 256
    kw["quantization"] = args.quantization
    kw["attention_backend"] = args.attention_backend
    if args.kv_cache_memory is not None:
        kw["kv_cache_bytes"] = parse_size(args.kv_cache_memory)
    status = LoadStatus(args.model or "smollm2-135m-instruct")
    try:
        return serve(model=args.model, host=args.host, port=args.port, dtype=args.dtype,
                     api_key=args.api_key or os.environ.get("ASYNCENGINE_API_KEY"),
                     max_model_len=args.max_model_len, seed=args.seed,
                     allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
                     metrics_public=args.metrics_public, limits=RequestLimits(**limits),
                     tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                     pipeline_parallel_size=args.pipeline_parallel_size,
                     distributed_executor_backend=args.distributed_executor_backend, num_threads=args.num_threads,
                     engine_core_process=args.engine_core_process, tp_vocab_parallel=args.tp_vocab_parallel,
                     ray_placement_strategy=args.ray_placement_strategy,
                     on_loaded=lambda: status.done(f"ready, serving on http://{args.host}:{args.port}"), **kw)
    except BaseException:
        status.done("stopped")
        raise
