"""``serve``'s chat-output flags (vLLM's names): the tool-call and reasoning parsers and the
default ``chat_template_kwargs``. Checked before the model loads."""
from __future__ import annotations

import argparse
import json

TOOL_CALL_PARSERS = ("hermes", "mistral", "llama3_json", "granite", "pythonic", "json_array")
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def _json_object(text: str) -> dict:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return obj


def add_chat_options(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("chat outputs (docs/integrations.md#tool-calls-and-reasoning)")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="read tool calls in the model's own format, tools rendered by its chat template "
                        "(hermes: Qwen2.5/Qwen3; default: this project's JSON array, tools in a system prompt)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide to call tools (tool_choice 'auto'; needs --tool-call-parser)")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="return <think> spans apart, as reasoning_content")
    g.add_argument("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="chat_template_kwargs of every request (a request's own override them key by key)")


def chat_config(args: argparse.Namespace):
    """The server's ChatConfig from the flags (ValueError for a combination that cannot work)."""
    from asyncengine.integrations.openai_server.chat_render import ChatConfig  # lazy: the server's modules only when serving

    return ChatConfig(tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                      reasoning_parser=args.reasoning_parser,
                      default_chat_template_kwargs=args.default_chat_template_kwargs or {})
