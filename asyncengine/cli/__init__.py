"""The ``asyncengine`` command: ``chat`` (streaming chat), ``generate`` (one-shot completion of raw
text) and ``serve`` (the OpenAI-compatible server).

Sampling flags left out take the model's defaults (its generation config, else the small-chat
defaults in asyncengine/engine/defaults.py); answers run until the model ends them or the context
is full, unless --max-tokens says otherwise.
"""
from __future__ import annotations

# First: importing status takes the launch time stamp, before anything else here is imported.
from asyncengine.cli.status import LAUNCHED

# Only the standard library at import time: `asyncengine --help` must not import torch. asyncio too
# is imported where a command needs it (it is half of --help's CPU time otherwise).
import argparse
import os
import sys

from asyncengine.cli import args as _args
from asyncengine.cli.args import EXIT_USAGE, parse_size
from asyncengine.cli.chat import read_piped, run_chat, run_generate
from asyncengine.cli.serve import run_serve

__all__ = ["LAUNCHED", "build_parser", "entry", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of the whole command, described by this package's docstring."""
    return _args.build_parser(__doc__)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # check what we can before loading the model (seconds): bad input fails at once
    if args.kv_cache_memory is not None:
        try:
            parse_size(args.kv_cache_memory)
        except argparse.ArgumentTypeError as e:
            ap.error(str(e))
    for name in ("max_model_len", "max_num_seqs", "max_tokens", "tensor_parallel_size", "data_parallel_size",
                 "pipeline_parallel_size", "num_threads"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.cmd == "serve" and not 0 < args.port < 65536:
        ap.error(f"--port must be in 1..65535, got {args.port}")
    lines = None
    if args.cmd == "chat":
        if args.prompt is not None:
            if not args.prompt.strip():
                ap.error("--prompt is empty")
            lines = [args.prompt]
        elif not sys.stdin.isatty():
            lines = read_piped()
            if not any(line.strip() and line.strip() not in ("/reset",) for line in lines):
                print("asyncengine: nothing to answer: stdin had no question", file=sys.stderr)
                return EXIT_USAGE
    elif args.cmd == "generate" and not args.prompt:
        ap.error("--prompt is empty")
    from asyncengine.errors import AsyncEngineError

    try:
        if args.cmd == "serve":
            return run_serve(args)
        import asyncio

        return asyncio.run(run_chat(args, lines) if args.cmd == "chat" else run_generate(args))
    except AsyncEngineError as e:
        print(f"asyncengine: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    """The console script (and ``python -m asyncengine``): main(), then exit without the
    interpreter's teardown for chat and generate. Unloading torch and a model's worth of objects
    took ~1.8 s after the answer was printed; everything is written and the engine is shut down by
    then, so there is nothing left to clean up but memory."""
    argv = sys.argv[1:]
    rc = main(argv)
    if argv and argv[0] in ("chat", "generate"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
