"""The ``chat`` and ``generate`` commands: build the engine with a status line, stream answers to
stdout with their speed on stderr, and run the conversation (a terminal, a pipe or one --prompt)
with Ctrl-C stopping an answer rather than the program. asyncio, torch and the engine are imported
inside the functions, so importing this module costs ``--help`` nothing.
"""
from __future__ import annotations

import sys
import time

from asyncengine.cli.args import SAMPLING_FIELDS, parse_size
from asyncengine.cli.status import LAUNCHED, LoadStatus


def _config(args):
    from asyncengine import EngineConfig

    kw = dict(model=args.model, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs or 1, quantization=args.quantization,
              attention_backend=args.attention_backend, engine_core_process=args.engine_core_process)
    if args.kv_cache_memory is not None:
        kw["kv_cache_bytes"] = parse_size(args.kv_cache_memory)
    if args.kv_offload_memory is not None:
        kw["kv_offload_bytes"] = parse_size(args.kv_offload_memory)
    kw["kv_offload_dir"] = args.kv_offload_dir
    return EngineConfig(**kw)


def _make_engine(args):
    config = _config(args)  # bad values fail here, before the model loads
    status = LoadStatus(args.model or "smollm2-135m-instruct")
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

    given = {f: getattr(args, f) for f in SAMPLING_FIELDS if getattr(args, f) is not None}
    if args.sample_seed is not None:
        given["seed"] = args.sample_seed
    # the defaults are a set, as in the server: picking any sampling knob drops the others' defaults
    picked = any(f in given for f in SAMPLING_FIELDS if f not in ("max_tokens", "stop"))
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
          f"{(first or t0) - LAUNCHED:.1f} s after launch{note}]", file=sys.stderr)
    return text


def read_piped() -> list[str]:
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


async def run_chat(args, lines: list[str] | None) -> int:
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


async def run_generate(args) -> int:
    engine = _make_engine(args)
    async with engine:
        await _stream_answer(engine, args.prompt, _params(engine, args))
    return 0
