"""Chat messages, tools and ``chat_template_kwargs`` through the model's own chat template, as
transformers' ``apply_chat_template(messages, tools=..., **kwargs)`` defines it (what vLLM does):
the model sees tools and earlier calls the way it was trained to.

The server's chat options (``ChatConfig``: ``serve --tool-call-parser``, ``--enable-auto-tool-choice``,
``--reasoning-parser``, ``--default-chat-template-kwargs``) live here too. Without a tool-call
parser the project's own format is used (integrations/tool_calls.py: a system prompt and a JSON
array), for templates that know no tools."""
from __future__ import annotations

import json

import msgspec

from asyncengine.config.request_limits import RequestLimitError

from ..chat_parsers import REASONING_FORMATS, TOOL_FORMATS
from .errors import APIError, from_engine

# keys of apply_chat_template that a request's chat_template_kwargs may not set
RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                             "return_dict", "return_tensors", "padding", "truncation", "max_length",
                             "add_generation_prompt", "continue_final_message", "return_assistant_tokens_mask",
                             "tokenizer_kwargs"})


class ChatConfig(msgspec.Struct, kw_only=True, frozen=True):
    """How the server reads chat outputs (vLLM's flag names)."""

    tool_call_parser: str | None = None  # None: the project's JSON-array format (tool_calls.py)
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    default_chat_template_kwargs: dict = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_FORMATS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r}: one of {', '.join(TOOL_FORMATS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_FORMATS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}: one of "
                             f"{', '.join(REASONING_FORMATS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        check_template_kwargs(self.default_chat_template_kwargs, "default_chat_template_kwargs")

    @property
    def native_tools(self) -> bool:
        """Tools go through the chat template and outputs are read in the model's format."""
        return self.tool_call_parser is not None and self.tool_call_parser != "json_array"


def check_template_kwargs(kw, param: str) -> dict:
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise APIError(400, f"{param} must be an object", param=param)
    bad = sorted(set(kw) & RESERVED_KWARGS)
    if bad:
        raise APIError(400, f"{param} may not set {', '.join(bad)}", param=f"{param}.{bad[0]}")
    return kw


def template_kwargs(config: ChatConfig, requested: dict | None) -> dict:
    """The server's defaults, overridden key by key by the request's."""
    return {**config.default_chat_template_kwargs, **check_template_kwargs(requested, "chat_template_kwargs")}


def template_messages(raw: list[dict], checked: list[dict]) -> list[dict]:
    """OpenAI messages (``raw``, already checked by the engine's rules into ``checked``) in the shape
    chat templates expect: an assistant's ``tool_calls`` kept with their arguments as objects (they
    arrive as JSON text), a tool turn's ``tool_call_id`` kept."""
    out = []
    for i, (m, c) in enumerate(zip(raw, checked)):
        c = dict(c)
        calls = m.get("tool_calls")
        if calls:
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise APIError(400, f"messages[{i}].tool_calls is only allowed on assistant messages, as a list",
                               param=f"messages[{i}].tool_calls")
            c["tool_calls"] = [_call(i, j, tc) for j, tc in enumerate(calls)]
        if m.get("tool_call_id") is not None:
            c["tool_call_id"] = m["tool_call_id"]
        out.append(c)
    return out


def _call(i: int, j: int, tc) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                            "'arguments': '<JSON>'}}}}", param=where)
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise APIError(400, f"{where}.function.arguments is not valid JSON",
                           param=f"{where}.function.arguments") from None
    call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if tc.get("id") is not None:
        call["id"] = tc["id"]
    return call


def render(tokenizer, messages: list[dict], tools: list[dict] | None, kwargs: dict, tokenize: bool = True):
    """Through the template: token ids (or the text, ``tokenize=False``). A template that refuses
    the conversation (a jinja error, its own raise_exception) is a 400."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template", param="messages")
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                            tokenize=tokenize, **kwargs)
    except Exception as e:
        raise APIError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                       param="messages") from None
    if tokenize and hasattr(out, "keys"):  # transformers 5 may return a BatchEncoding
        out = out["input_ids"]
    return list(out) if tokenize else out


def checked_messages(raw: list[dict], engine) -> list[dict]:
    """The engine's own checks (roles, contents, sizes: ``engine.check_messages``, the engine-client
    protocol), then the template's shape."""
    try:
        checked = engine.check_messages(raw)
    except RequestLimitError as e:
        raise from_engine(e, None) from None
    return template_messages(raw, checked)
