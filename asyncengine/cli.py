"""The ``asyncengine`` command: ``chat`` (streaming terminal chat), ``generate`` (one-shot
completion) and ``serve`` (the OpenAI-compatible server)."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time


def _engine_args(p: argparse.ArgumentParser, positional_model: bool = True) -> None:
    if positional_model:
        p.add_argument("model", nargs="?", default=None,
                       help="model name (smollm2-135m-instruct, the default), HF folder or .gguf file")
    else:
        p.add_argument("--model", default=None, help="model name, HF folder or .gguf file")
    p.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has it), float32, bfloat16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


def _distributed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many worker processes (Megatron tensor parallel)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="run this many engine cores (processes), each with its own KV cache")
    p.add_argument("--distributed-executor-backend", choices=["uni", "mp", "ray"], default=None,
                   help="uni: one thread (TP=1 default); mp: worker processes (TP>1 default); ray: Ray actors")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per worker (default: torch's)")


def _sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)


def _make_engine(args):
    from asyncengine import AsyncLLMEngine, EngineConfig

    return AsyncLLMEngine.from_config(EngineConfig(model=args.model, dtype=args.dtype, seed=args.seed,
                                                   max_model_len=args.max_model_len))


def _params(args):
    from asyncengine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k)


async def _stream_answer(engine, prompt, params, out=sys.stdout) -> str:
    """Stream one answer to ``out``; returns its text and prints the speed to stderr."""
    t0 = time.perf_counter()
    first = None
    text, n = "", 0
    async for o in engine.generate(prompt, params):
        if first is None and o.token_ids_delta:
            first = time.perf_counter()
        out.write(o.text_delta)
        out.flush()
        text += o.text_delta
        n += len(o.token_ids_delta)
    dt = time.perf_counter() - (first or t0)
    out.write("\n")
    out.flush()
    rate = (n - 1) / dt if n > 1 and dt > 0 else 0.0
    print(f"[{n} tokens, {rate:.1f} tok/s, first token after {((first or t0) - t0) * 1000:.0f} ms]",
          file=sys.stderr)
    return text


async def _chat(args) -> int:
    from asyncengine import InvalidRequestError

    engine = _make_engine(args)
    params = _params(args)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = args.prompt is None and sys.stdin.isatty()
    async with engine:
        if args.prompt is not None or not interactive:
            lines = [args.prompt] if args.prompt is not None else [l.rstrip("\n") for l in sys.stdin]
            for line in lines:
                if not line.strip():
                    continue
                history.append({"role": "user", "content": line})
                if not interactive:
                    print(f"> {line}", file=sys.stderr)
                answer = await _stream_answer(engine, history, params)
                history.append({"role": "assistant", "content": answer})
            return 0
        print("asyncengine chat — /reset clears the conversation, Ctrl-D exits.", file=sys.stderr)
        loop = asyncio.get_running_loop()
        while True:
            try:
                line = await loop.run_in_executor(None, input, "> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            if not line.strip():
                continue
            if line.strip() == "/reset":
                history = history[:1] if args.system else []
                print("(conversation cleared)", file=sys.stderr)
                continue
            history.append({"role": "user", "content": line})
            try:
                answer = await _stream_answer(engine, history, params)
            except InvalidRequestError as e:  # e.g. the conversation outgrew max_model_len
                print(f"error: {e} — /reset to start over", file=sys.stderr)
                history.pop()
                continue
            history.append({"role": "assistant", "content": answer})


async def _generate(args) -> int:
    engine = _make_engine(args)
    async with engine:
        await _stream_answer(engine, args.prompt, _params(args))
    return 0


def _serve(args) -> int:
    from asyncengine.engine.validation import RequestLimits
    from asyncengine.integrations.openai_server import serve

    limits = {k: v for k, v in (("max_request_bytes", args.max_request_bytes),
                                ("max_prompt_chars", args.max_prompt_chars),
                                ("max_stop_strings", args.max_stop_strings),
                                ("max_stop_string_chars", args.max_stop_string_chars),
                                ("max_n", args.max_n)) if v is not None}
    admission = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                   ("max_queued_requests", args.max_queued_requests),
                                   ("max_queued_tokens", args.max_queued_tokens)) if v is not None}
    return serve(model=args.model, host=args.host, port=args.port, dtype=args.dtype,
                 api_key=args.api_key or os.environ.get("ASYNCENGINE_API_KEY"),
                 max_model_len=args.max_model_len, seed=args.seed,
                 allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
                 metrics_public=args.metrics_public, limits=RequestLimits(**limits), **admission,
                 tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                 distributed_executor_backend=args.distributed_executor_backend, num_threads=args.num_threads)


def _serve_args(s: argparse.ArgumentParser) -> None:
    """Admission limits, request limits and browser protections of ``serve`` (security.py)."""
    s.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    s.add_argument("--allowed-hosts", type=_csv, default=None,
                   help="Host names to answer besides the defaults (loopback names when bound to loopback, "
                        "the bound address otherwise); '*' for any (comma-separated)")
    s.add_argument("--allowed-origins", type=_csv, default=(),
                   help="browser origins (https://app.example) allowed to call the API besides this "
                        "server's own; also turns CORS on for them (comma-separated)")
    s.add_argument("--max-num-seqs", type=int, default=None, help="requests in the running batch (default 256)")
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncengine", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("chat", help="interactive streaming chat (or one turn with --prompt / stdin)")
    _engine_args(c)
    _sampling(c)
    c.add_argument("--prompt", default=None, help="ask one question and exit")
    c.add_argument("--system", default=None, help="a system prompt")
    g = sub.add_parser("generate", help="one-shot completion of a raw prompt")
    _engine_args(g, positional_model=False)
    _sampling(g)
    g.add_argument("--prompt", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (+ websocket streaming)")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require this bearer key (or ASYNCENGINE_API_KEY)")
    _serve_args(s)
    _distributed(s)
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from asyncengine.errors import AsyncEngineError

    try:
        if args.cmd == "serve":
            return _serve(args)
        return asyncio.run(_chat(args) if args.cmd == "chat" else _generate(args))
    except AsyncEngineError as e:
        print(f"asyncengine: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
