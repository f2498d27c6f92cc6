"""The command line's table of engine knobs against EngineConfig, its help texts, and the chat's
repetition guard (no model needed)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import types

import pytest

from asyncengine.cli import args as cli_args
from asyncengine.cli import build_parser, main
from asyncengine.cli.repetition import RepetitionGuard
from asyncengine.config import EngineConfig

# a valid non-default value for every knob in the table, to check each one reaches EngineConfig
SAMPLE_VALUES = {
    "tokenizer": ("some/tokenizer", "some/tokenizer"), "dtype": ("float32", "float32"), "device": ("cpu", "cpu"),
    "quantization": ("int8", "int8"), "max_model_len": ("512", 512), "kv_cache_bytes": ("2MiB", 2 << 20),
    "kv_cache_memory_fraction": ("0.5", 0.5), "num_kv_blocks": ("64", 64), "block_size": ("32", 32),
    "max_num_seqs": ("3", 3), "max_num_batched_tokens": ("1024", 1024), "enable_prefix_caching": (None, False),
    "enable_chunked_prefill": (None, False), "async_scheduling": (None, False), "policy": ("priority", "priority"),
    "priority_aging_s": ("2.5", 2.5), "max_queued_requests": ("7", 7), "max_queued_tokens": ("900", 900),
    "attention_backend": ("torch", "torch"), "seed": ("5", 5), "quantized_activations": ("fp32", "fp32"), "batch_invariant": (None, True), "restart_dead_cores": (None, True), "pipeline_parallel_size": ("2", 2),
    "kv_offload_bytes": ("1GiB", 1 << 30), "kv_offload_dir": ("/tmp/kv", "/tmp/kv"), "kv_offload_dir_bytes": ("2GiB", 2 << 30), "num_threads": ("1", 1),
    "freeze_gc_after_load": (None, False), "engine_core_process": (None, True), "tensor_parallel_size": ("2", 2),
    "data_parallel_size": ("2", 2), "distributed_executor_backend": ("mp", "mp"), "distributed_timeout_s": ("9", 9.0),
    "tp_vocab_parallel": (None, False), "ray_placement_strategy": ("SPREAD", "SPREAD"),
    "enable_expert_parallel": (None, True),
    "prefill_cores": ("1", 1), "decode_cores": ("2", 2), "pd_skip_hop_below": ("48", 48),
    "kv_transfer_transport": ("tcp", "tcp"), "kv_cache_dtype": ("int8", "int8"),
    "enable_lora": (None, True), "max_loras": ("3", 3), "max_lora_rank": ("32", 32), "max_cpu_loras": ("4", 4),
    "model_impl": ("transformers", "transformers"),
    "limit_mm_per_prompt": ("3", 3), "mm_max_pixels": ("1000000", 1000000), "mm_encoder_cache_tokens": ("512", 512),
    "max_num_encoder_input_tokens": ("48", 48),
    "runner": ("pooling", "pooling"),
    "gpu_memory_utilization": ("0.5", 0.5), "enforce_eager": (None, True),
    "speculative_config": ('{"method": "ngram", "num_speculative_tokens": 2}',
                           {"method": "ngram", "num_speculative_tokens": 2}),
}


def test_every_engine_config_field_is_on_the_command_line_or_says_why_not():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    in_table = [o.field for o in cli_args.ENGINE_OPTIONS]
    assert len(in_table) == len(set(in_table))
    assert set(in_table) | set(cli_args.NOT_ON_THE_COMMAND_LINE) == fields, \
        "a new EngineConfig field needs a row in cli/args.py's ENGINE_OPTIONS (or a reason not to)"
    assert not set(in_table) & set(cli_args.NOT_ON_THE_COMMAND_LINE)
    assert set(SAMPLE_VALUES) == set(in_table)


@pytest.mark.parametrize("opt", cli_args.ENGINE_OPTIONS, ids=lambda o: o.field)
def test_each_knob_reaches_engine_config(opt):
    text, expected = SAMPLE_VALUES[opt.field]
    flag = "--no-" + opt.option[2:] if text is None and expected is False else opt.option
    argv_tail = [flag] if text is None else [flag, text]
    for command in opt.commands:
        head = [command, "--prompt", "x"] if command in cli_args.ONE_SHOT else [command]
        ns = build_parser().parse_args(head + argv_tail)
        kw = cli_args.engine_kwargs(ns)
        assert kw[opt.field] == expected
    for command in set(cli_args.COMMANDS) - set(opt.commands):  # serve-only knobs are not offered elsewhere
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args([command, "--prompt", "x"] + argv_tail)


def test_unset_knobs_keep_engine_config_defaults_and_help_shows_them():
    ns = build_parser().parse_args(["serve"])
    assert cli_args.engine_kwargs(ns) == {"max_num_seqs": 256}
    ns = build_parser().parse_args(["chat"])
    assert cli_args.engine_kwargs(ns) == {"max_num_seqs": 1}
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    help_text = _help(["serve", "--help"])
    for opt in cli_args.ENGINE_OPTIONS:
        if opt.default_text is None and not opt.per_command:
            shown = cli_args.default_text(opt, "serve", defaults)
            value = defaults[opt.field]
            assert shown == ({True: "on", False: "off"}[value] if isinstance(value, bool) else str(value))
            assert f"(default: {shown})" in " ".join(help_text.split()), opt.field


def _help(argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    return out.getvalue()


def test_help_texts_are_plain_and_show_effective_defaults():
    for argv in (["--help"], ["chat", "--help"], ["generate", "--help"], ["serve", "--help"]):
        text = _help(argv)
        assert "``" not in text and ":func:" not in text, argv
    flat = " ".join(_help(["chat", "--help"]).split())
    assert "OpenAI's presence penalty (default: the model's own, else 0.3)" in flat  # not "0"
    assert "--stop-repeats N" in flat and "(default: 3)" in flat
    flat = " ".join(_help(["generate", "--help"]).split())
    assert f"(default: {cli_args.GENERATE_MAX_TOKENS})" in flat
    assert build_parser().parse_args(["generate", "--prompt", "x"]).max_tokens == cli_args.GENERATE_MAX_TOKENS


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object"),
    ('{"method": "nope"}', "speculative"),  # EngineConfig's own check, before any model loads
])
def test_speculative_config_errors_are_usage_errors(bad, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["chat", "/no/such/model", "--prompt", "hi", "--speculative-config", bad])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "loading" not in err


def test_bad_numbers_fail_before_loading(capsys):
    for argv in (["chat", "--max-tokens", "0"], ["serve", "-tp", "0"], ["generate", "--prompt", "x", "--block-size", "3"],
                 ["chat", "--stop-repeats", "-1"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2, argv
        assert "loading" not in capsys.readouterr().err


def test_responses_store_flags_fail_before_loading(capsys):
    assert main(["serve", "--responses-store-size", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--responses-store-size must be >= 0" in err and "loading" not in err
    with pytest.raises(SystemExit) as info:
        main(["serve", "--responses-store-ttl", "0"])
    assert info.value.code == 2 and "--responses-store-ttl" in capsys.readouterr().err


def test_lora_modules_flag_parses_name_path_and_fails_before_loading(capsys):
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "sql=/a/b", "chat=/c"])
    assert args.lora_modules == [("sql", "/a/b"), ("chat", "/c")]
    with pytest.raises(SystemExit) as info:
        main(["serve", "--enable-lora", "--lora-modules", "no-equals-sign"])
    assert info.value.code == 2 and "name=path" in capsys.readouterr().err
    assert main(["serve", "--lora-modules", "sql=/a/b"]) == 2
    err = capsys.readouterr().err
    assert "--lora-modules needs --enable-lora" in err and "loading" not in err


# ------------------------------------------------------------------------------ repetition guard


def test_repetition_guard_finds_a_loop_of_any_period():
    for period in (1, 5, 17, 60):
        span = list(range(1000, 1000 + period))
        g = RepetitionGuard(repeats=3, min_tokens=48)
        tokens = list(range(7)) + span * 200
        loop_tokens = max(3 * period, 48)  # three copies, and 48 tokens of loop at least
        for i, t in enumerate(tokens):
            if g.feed([t]):
                assert i + 1 == 7 + loop_tokens, (period, i)
                assert g.period == period
                break
        else:
            raise AssertionError(f"period {period} not found")


def test_repetition_guard_lets_ordinary_text_and_short_repeats_through():
    import random

    rng = random.Random(0)
    g = RepetitionGuard(repeats=3)
    assert not g.feed([rng.randrange(50) for _ in range(2000)])  # random tokens: no verbatim loop of 48+
    g = RepetitionGuard(repeats=3)
    assert not g.feed([1, 2] * 10 + [3, 4, 5] * 5)  # "ha ha ha": too short to be a loop
    g = RepetitionGuard(repeats=3)
    assert not g.feed(list(range(100)) * 2)  # a span said twice is not yet a loop at repeats=3
    assert g.feed(list(range(100)))
    with pytest.raises(ValueError):
        RepetitionGuard(repeats=1)


class _LoopingEngine:
    """Streams one sentence forever; records whether the stream was closed."""

    def __init__(self):
        self.closed = False

    def generate(self, prompt, params):
        engine = self

        class Stream:
            def __aiter__(self):
                return self

            async def __anext__(self):
                await asyncio.sleep(0)
                return types.SimpleNamespace(token_ids_delta=[1, 2, 3, 4, 5, 6, 7, 8], text_delta="I like cats. ",
                                             finished=False, outputs=[])

            async def aclose(self):
                engine.closed = True

        return Stream()


def test_chat_ends_a_looping_answer_and_aborts_it(capsys):
    from asyncengine.cli.chat import _stream_answer

    args = build_parser().parse_args(["chat"])
    engine = _LoopingEngine()
    out = io.StringIO()
    text = asyncio.run(_stream_answer(engine, "q", types.SimpleNamespace(max_tokens=None), args, out=out))
    assert engine.closed
    assert text.count("I like cats.") == 6  # 48 tokens in all: max(3 copies, 48 tokens)
    assert "stopped: the answer repeated itself 3 times (--stop-repeats N to change, 0 = off)" in capsys.readouterr().err


def test_warm_up_runs_for_conversations_and_serve_only_unless_asked():
    def wanted(argv):
        return cli_args.warm_up_wanted(build_parser().parse_args(argv))

    assert wanted(["chat"]) and wanted(["serve"])
    assert not wanted(["chat", "--prompt", "x"]) and not wanted(["generate", "--prompt", "x"])
    assert wanted(["generate", "--prompt", "x", "--warm-up"]) and not wanted(["serve", "--no-warm-up"])


# ------------------------------------------------------------------------------ polish


@pytest.mark.parametrize("argv, says", [
    (["chat", "--temperature", "abc"], "asyncengine chat: error: argument --temperature: invalid float value: 'abc'"),
    (["chat", "--top-p", "2"], "asyncengine chat: error: --top-p must be in (0, 1], got 2.0"),
    (["generate", "--prompt", "x", "--sample-seed", "-1"], "asyncengine generate: error: --sample-seed must be in"),
    (["generate", "--prompt", "x", "--bogus"], "asyncengine generate: error: unrecognized arguments: --bogus"),
    (["generate", "/no/such/model.gguf", "--prompt", "x"], "asyncengine generate: error: No model at '/no/such/model.gguf'"),
    (["chat", "a-model", "--model", "another"], "two models given: 'a-model' and --model 'another'"),
])
def test_a_usage_error_is_one_line_with_a_help_hint_before_anything_loads(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err  # one line, not the usage
    assert err.rstrip().endswith(f"(see `asyncengine {argv[0]} --help`)")


@pytest.mark.parametrize("command", cli_args.COMMANDS)
def test_every_command_takes_the_model_as_a_flag_or_positionally(command, tmp_path, monkeypatch):
    folder = str(tmp_path)  # an existing folder passes the check before loading
    seen = []
    monkeypatch.setattr("asyncengine.cli.run_serve", lambda args: seen.append(args.model) or 0)
    monkeypatch.setattr("asyncengine.cli.run_generate", lambda args: _done(seen, args))
    monkeypatch.setattr("asyncengine.cli.run_chat", lambda args, lines: _done(seen, args))
    tail = ["--prompt", "x"] if command in cli_args.ONE_SHOT else []
    assert main([command, folder, *tail]) == 0
    assert main([command, "--model", folder, *tail]) == 0
    assert main([command, folder, "--model", folder, *tail]) == 0  # the same one twice is fine
    assert seen == [folder] * 3


async def _nothing() -> int:
    return 0


def _done(seen: list, args) -> object:
    seen.append(args.model)
    return _nothing()


def test_the_readme_names_every_engine_flag_chat_and_generate_do_not_take():
    readme = (cli_args.__file__.rsplit("/asyncengine/", 1)[0] + "/README.md")
    text = " ".join(open(readme).read().split())
    sentence = text[text.index("Every `EngineConfig` knob is a flag of all three commands"):]
    serve_only = sentence[sentence.index("which only `serve` takes"):sentence.index("; they are generated")]
    for opt in cli_args.ENGINE_OPTIONS:  # (that the others parse for each command: test_each_knob_...)
        named = f"`{opt.option}`" in serve_only
        assert named == (set(opt.commands) != set(cli_args.COMMANDS)), \
            f"README's list of serve-only flags is wrong about {opt.option}"
