"""The ``chat`` and ``generate`` commands: build the engine with a status line, stream answers to
stdout with their speed on stderr, and run the conversation (a terminal, a pipe or one --prompt)
with Ctrl-C stopping an answer rather than the program. asyncio, torch and the engine are imported
inside the functions, so importing this module costs ``--help`` nothing.
"""
from __future__ import annotations

import sys
import time

from asyncengine.cli.args import EXIT_FAILED, GENERATE_MAX_TOKENS, engine_config_of, sampling_params_of, warm_up_wanted
from asyncengine.cli.repetition import RepetitionGuard
from asyncengine.cli.status import LAUNCHED, LoadStatus
from asyncengine.errors import InvalidRequestError


def _config(args):
    """The EngineConfig the flags' check built (cli/__init__.py), or one built here (a caller that
    skipped the check)."""
    if getattr(args, "engine_config", None) is not None:
        return args.engine_config
    return engine_config_of(args)


async def _make_engine(args):
    """Build the engine and, for a conversation, pay the first request's one-time costs
    (engine/warmup.py) before the ready line, which names the dtype and why it was chosen."""
    config = _config(args)  # bad values fail here, before the model loads
    status = LoadStatus(args.model or "smollm2-135m-instruct")
    try:
        from asyncengine import AsyncLLMEngine  # lazy: the CLI parses and checks flags without importing the engine (start-up time)
        from asyncengine.engine.warmup import warm_up  # lazy: the CLI parses and checks flags without importing the engine (start-up time)

        engine = AsyncLLMEngine.from_config(config)
        if warm_up_wanted(args):
            status.step("warming up")
            await warm_up(engine)
    except BaseException:
        status.done("loading failed")
        raise
    status.done(f"ready, {engine.kernels}")
    return engine


def _params(engine, args):

    # the flags given; the engine fills the others from the model's defaults (resolved here, once,
    # because the cut note reads max_tokens)
    return engine.check_sampling_params(sampling_params_of(args))


def _cut_note(args, params, reason: str | None, n: int, looped: bool) -> str:
    if looped:
        return (f", stopped: the answer repeated itself {args.stop_repeats} times "
                f"(--stop-repeats N to change, 0 = off)")
    if reason != "length":
        return ""
    if params.max_tokens is not None and n >= params.max_tokens:
        if args.cmd == "generate" and args.max_tokens == GENERATE_MAX_TOKENS:
            return f", cut at {GENERATE_MAX_TOKENS} tokens, generate's default (--max-tokens N for more)"
        return f", cut at --max-tokens {params.max_tokens}"
    return ", cut: the context is full" + (" (/reset to start over)" if args.cmd == "chat" and args.prompt is None
                                          else "")


async def _stream_answer(engine, prompt, params, args, out=None) -> str:
    """Stream one answer to ``out`` (stdout); returns its text. Prints the speed to stderr, and
    says so when the answer was cut (max tokens, a full context, a loop that --stop-repeats
    ended). Cancelling (Ctrl-C) aborts it."""

    out = out or sys.stdout
    guard = RepetitionGuard(args.stop_repeats) if args.stop_repeats >= 2 else None
    t0 = time.monotonic()
    first = None
    text, n, reason, looped = "", 0, None, False
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
            elif guard is not None and guard.feed(o.token_ids_delta):
                looped = True
                break  # leaving the stream aborts the request
    finally:
        await stream.aclose()
        out.write("\n")
        out.flush()
    dt = time.monotonic() - (first or t0)
    rate = (n - 1) / dt if n > 1 and dt > 0 else 0.0
    print(f"[{n} tokens, {rate:.1f} tok/s, first token {((first or t0) - t0) * 1000:.0f} ms after the question, "
          f"{(first or t0) - LAUNCHED:.1f} s after launch{_cut_note(args, params, reason, n, looped)}]",
          file=sys.stderr)
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



    engine = await _make_engine(args)
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
    failed = 0  # questions that got no answer: the exit status says so (a script can tell)
    async with engine:
        if lines is None:
            print("asyncengine chat — /reset clears the conversation, /exit or Ctrl-D quits, "
                  "Ctrl-C stops an answer.", file=sys.stderr)
        it = iter(lines) if lines is not None else None
        while True:
            if it is not None:
                line = next(it, None)
                if line is None:
                    return EXIT_FAILED if failed else 0
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
            task = asyncio.ensure_future(_stream_answer(engine, history, params, args))
            answering[:] = [task]
            try:
                answer = await task
            except InvalidRequestError as e:  # e.g. the conversation outgrew max_model_len
                history.pop()
                failed += 1
                hint = ""
                if args.prompt is None:  # a conversation goes on: say how to make room
                    hint = (" (/reset clears the conversation)" if len(history) > len(base)
                            else " (ask a shorter question, or raise --max-model-len)")
                print(f"asyncengine: error: {e}{hint}", file=sys.stderr)
                if args.prompt is not None:
                    return EXIT_FAILED
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

    engine = await _make_engine(args)
    async with engine:
        try:
            await _stream_answer(engine, args.prompt, _params(engine, args), args)
        except InvalidRequestError as e:  # e.g. a prompt longer than the context
            print(f"asyncengine: error: {e}", file=sys.stderr)
            return EXIT_FAILED
    return 0
