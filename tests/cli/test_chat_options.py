"""serve's chat-output flags: parsed and checked before any model loads."""
from __future__ import annotations

import pytest

from asyncengine.cli.args import build_parser
from asyncengine.cli.chat_options import chat_config


def _serve(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_flags_become_the_chat_config():
    cfg = chat_config(_serve("--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--reasoning-parser",
                             "qwen3", "--default-chat-template-kwargs", '{"enable_thinking": false}'))
    assert (cfg.tool_call_parser, cfg.enable_auto_tool_choice, cfg.reasoning_parser) == ("hermes", True, "qwen3")
    assert cfg.default_chat_template_kwargs == {"enable_thinking": False} and cfg.native_tools
    plain = chat_config(_serve())
    assert plain.tool_call_parser is None and not plain.native_tools and plain.reasoning_parser is None


@pytest.mark.parametrize("argv", [["--tool-call-parser", "nope"], ["--reasoning-parser", "nope"],
                                  ["--default-chat-template-kwargs", "[1]"],
                                  ["--default-chat-template-kwargs", "{bad"]])
def test_bad_values_are_usage_errors(argv):
    with pytest.raises(SystemExit):
        _serve(*argv)


def test_auto_tool_choice_needs_a_parser():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        chat_config(_serve("--enable-auto-tool-choice"))
