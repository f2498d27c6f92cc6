"""Request bodies of the OpenAI-compatible API as msgspec Structs: decoded and validated in one
pass. Unknown fields are ignored (OpenAI clients send many we have no use for); a field of the
wrong type or out of range is a 400 naming that field.

Besides OpenAI's fields, the vLLM extras that map onto SamplingParams are accepted too (top_k,
min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, and the structured-output fields of guided.py): clients send them with
``extra_body``.
"""
from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from .errors import APIError

MAX_N = 128  # OpenAI's limit on n
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs

PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """The sampling knobs both endpoints (and the websocket chat frames) share."""

    model: str | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    stop_token_ids: list[NonNegInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured outputs: OpenAI's response_format, or vLLM's fields (one of them; guided.py)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: Any = None


class CompletionRequest(SamplingFields, kw_only=True):
    # str, list[str], list[int] or list[list[int]]: msgspec unions allow one array type, so the
    # list is checked by hand (prompts_of in app.py)
    prompt: str | list[Any]
    max_tokens: PosInt | None = 16
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    best_of: PosInt | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class ContentPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None  # {"url": "data:image/png;base64,..."} (media.py)


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    # checked by the engine's own rules (asyncengine/engine/validation.py: check_messages): a
    # message needs a content (null allowed), so a missing one stays missing here
    role: str
    content: str | list[ContentPart] | None | msgspec.UnsetType = msgspec.UNSET
    name: str | None = None
    # earlier tool use: an assistant turn's calls, a tool turn's answer to one (shapes are checked
    # where they become prompt text: integrations/tool_calls.py, openai_history)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatFields(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: PosInt | None = None
    max_completion_tokens: PosInt | None = None
    # passed to the chat template (e.g. {"enable_thinking": false}); over the server's defaults
    chat_template_kwargs: dict[str, Any] | None = None
    # serve --reasoning-parser: at most this many tokens of reasoning, then its end is forced
    max_reasoning_tokens: NonNegInt | None = None


class ChatCompletionRequest(ChatFields, kw_only=True):
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    # tool calls (integrations/openai_server/tools.py)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None


# ---------------------------------------------------------------- websocket frames

FrameId = str | int | None


class WSChat(ChatFields, kw_only=True, tag="chat", tag_field="type"):
    id: FrameId = None


class WSCancel(msgspec.Struct, kw_only=True, tag="cancel", tag_field="type"):
    id: FrameId = None


class WSPing(msgspec.Struct, kw_only=True, tag="ping", tag_field="type"):
    id: FrameId = None


WSFrame = WSChat | WSCancel | WSPing


# ---------------------------------------------------------------- decoding

_AT = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def _bad_body(e: msgspec.MsgspecError) -> APIError:
    """msgspec's message names the field: "... - at `$.messages[0].role`" -> param messages[0].role."""
    msg = str(e)
    m = _AT.search(msg)
    param = m.group(1) if m and m.group(1) else None
    missing = _MISSING.search(msg)
    if missing:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    return APIError(400, f"invalid request body: {msg}", param=param)


def decode(body: bytes, typ: type):
    """JSON bytes -> a validated ``typ``; raises APIError(400) naming the bad field."""
    if not body:
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        # lax, as OpenAI's own (pydantic) validation: 2.0 is an integer, "0.5" a number
        return msgspec.json.decode(body, type=typ, strict=False)
    except msgspec.MsgspecError as e:
        raise _bad_body(e) from None


def convert(obj: Any, typ: type):
    """An already-decoded JSON value -> a validated ``typ`` (websocket frames)."""
    try:
        return msgspec.convert(obj, type=typ, strict=False)
    except msgspec.MsgspecError as e:
        raise _bad_body(e) from None


# ---------------------------------------------------------------- /tokenize, /detokenize (vLLM's shapes)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """A text (``prompt``) or a conversation (``messages``, rendered as /v1/chat/completions does)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[Annotated[int, msgspec.Meta(ge=0)]]
