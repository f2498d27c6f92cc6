"""The ``asyncengine`` command: ``chat`` (streaming chat), ``generate`` (one-shot completion of raw
text) and ``serve`` (the OpenAI-compatible server). What ``asyncengine --help`` shows is
``args.DESCRIPTION``; every option is in ``args.py``.
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
from asyncengine.cli.args import EXIT_USAGE
from asyncengine.cli.chat import read_piped, run_chat, run_generate
from asyncengine.cli.serve import run_serve
from asyncengine.errors import AsyncEngineError, ConfigError, InvalidRequestError

__all__ = ["LAUNCHED", "build_parser", "entry", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of the whole command."""
    return _args.build_parser()


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, unknown = ap.parse_known_args(argv)
    sub = ap._subparsers._group_actions[0].choices[args.cmd]  # errors name the command: "asyncengine chat: ..."
    if unknown:
        sub.error(f"unrecognized arguments: {' '.join(unknown)}")
    _args.model_of(sub, args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # check what we can before loading the model (seconds): bad input fails at once (the flags'
    # types check numbers and sizes; EngineConfig checks how they go together, SamplingParams the
    # sampling values; the model must be one we can load)
    if getattr(args, "stop_repeats", 0) < 0:
        sub.error("--stop-repeats must be >= 0 (0 turns the guard off)")

    try:  # how the engine flags go together, before the model loads: the command's one EngineConfig
        args.engine_config = _args.engine_config_of(args)
    except ConfigError as e:
        sub.error(str(e))
    if args.cmd != "serve":
        try:
            _args.sampling_params_of(args)
        except InvalidRequestError as e:
            sub.error(_args.as_flag_message(str(e)))
    if args.cmd == "serve" and not 0 < args.port < 65536:
        sub.error(f"--port must be in 1..65535, got {args.port}")
    lines = None
    if args.cmd == "chat":
        if args.prompt is not None:
            if not args.prompt.strip():
                sub.error("--prompt is empty")
            lines = [args.prompt]
        elif not sys.stdin.isatty():
            lines = read_piped()
            if not any(line.strip() and line.strip() not in ("/reset",) for line in lines):
                print("asyncengine: nothing to answer: stdin had no question", file=sys.stderr)
                return EXIT_USAGE
    elif args.cmd == "generate" and not args.prompt:
        sub.error("--prompt is empty")
    if args.cmd != "serve" and (why := _args.model_problem(args.model)) is not None:  # serve: after its port
        sub.error(why)
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
