"""Anthropic's Messages API: ``POST /v1/messages``, streaming or not, with tool use.

A request is one chat turn (chat_turn.py): ``system`` becomes the system message, ``tool_use``
blocks an assistant turn's calls and ``tool_result`` blocks tool turns; tools and ``tool_choice``
go through the tool seam (tool_adapter.py: chat's template rendering and parsers; with
``--reasoning-parser`` the reasoning comes as a ``thinking`` block, and ``thinking`` switches it off
or sets its budget). Errors have Anthropic's shape (errors.py picks it by
path) and the key may come as ``x-api-key`` (security.py).
"""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from .chat_turn import Tally, Turn, final_output, finish_kind, start_turn, tool_events
from .errors import APIError, anthropic_body
from .protocol import SamplingFields
from .sse import ClientGone, SSEResponse
from .state import json_response as _json, server_state as _state
from .tool_adapter import CallArgs, CallBegin, CallEnd, ReasoningDelta, TextDelta, ToolEvent, ToolSession


class Block(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class Message(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Conversation(msgspec.Struct, kw_only=True):
    """What a prompt is made of (the body of /v1/messages/count_tokens)."""

    model: str
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    system: str | list[Block] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # {"type": "enabled", "budget_tokens"} | {"type": "disabled"}


class MessagesRequest(Conversation, kw_only=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema"}}
    structured_outputs: dict[str, Any] | None = None  # vLLM's extra, as on chat (e.g. {"regex": ...})


def _texts(blocks: list[Block] | list[dict] | str | None, where: str) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    out = []
    for j, b in enumerate(blocks):
        kind, text = (b.get("type"), b.get("text")) if isinstance(b, dict) else (b.type, b.text)
        if kind != "text" or not isinstance(text, str):
            raise APIError(400, f"{where}[{j}]: only text blocks are supported here, got {kind!r:.40}",
                           param=f"{where}[{j}]")
        out.append(text)
    return "\n".join(out)


def chat_messages(req: Conversation) -> list[dict]:
    """The conversation as chat messages: text, tool_use (assistant calls), tool_result (tool turns)."""
    out: list[dict] = [{"role": "system", "content": _texts(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls = [], []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text" and isinstance(b.text, str):
                texts.append(b.text)
            elif b.type == "tool_use" and m.role == "assistant" and isinstance(b.name, str) and isinstance(b.id, str) \
                    and isinstance(b.input, dict):
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input or {}, ensure_ascii=False)}})
            elif b.type == "tool_result" and m.role == "user" and isinstance(b.tool_use_id, str):
                text = _texts(b.content, f"{where}.content")
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": f"Error: {text}" if b.is_error else text})
            elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier thinking is not shown to the model again
            else:
                raise APIError(400, f"{where}: a {b.type!r:.40} block is not supported in a {m.role} message "
                                    "(text; tool_use from the assistant; tool_result from the user)", param=where)
        if texts or calls or not m.content:
            msg: dict = {"role": m.role, "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _thinking(st, config: dict | None) -> tuple[dict | None, int | None]:
    """``thinking`` as chat's (chat_template_kwargs, max_reasoning_tokens): "disabled" switches a
    template's thinking off, "enabled" holds the span to ``budget_tokens``. Without
    ``--reasoning-parser`` the server reads no reasoning, and the field changes nothing."""
    if config is None or st.chat_config.reasoning_parser is None:
        return None, None
    kind = config.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}, None
    if kind == "enabled":
        budget = config.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise APIError(400, "thinking.budget_tokens must be a non-negative integer",
                           param="thinking.budget_tokens")
        return None, budget
    if kind == "adaptive":
        return None, None
    raise APIError(400, "thinking.type must be enabled, disabled or adaptive", param="thinking.type")


def chat_tools(st, req: Conversation) -> ToolSession:
    tools = []
    for i, t in enumerate(req.tools or ()):
        if t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
            raise APIError(400, f"tools[{i}]: only client tools ({{'name', 'description', 'input_schema'}}) are "
                                f"supported, got type {t.get('type')!r:.40}", param=f"tools[{i}]")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if t.get("description"):
            fn["description"] = t["description"]
        tools.append({"type": "function", "function": fn})
    tc = req.tool_choice or {"type": "auto"}
    kind = tc.get("type")
    if kind == "tool":
        choice: Any = {"type": "function", "function": {"name": tc.get("name")}}
    elif kind in ("auto", "any", "none"):
        choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise APIError(400, "tool_choice.type must be auto, any, tool or none", param="tool_choice")
    kwargs, budget = _thinking(st, req.thinking)
    return ToolSession(st, tools, choice, not tc.get("disable_parallel_tool_use", False), param="tool_choice",
                       chat_template_kwargs=kwargs, max_reasoning_tokens=budget)


def _output_format(config: dict | None) -> dict | None:
    """``output_config.format`` (Anthropic's structured outputs) as chat's ``response_format``."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                       param="output_config.format")
    return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}


def _stop(out, has_calls: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished output."""
    reason, stop = finish_kind(out)
    if reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if stop is not None:
        return "stop_sequence", stop
    return "end_turn", None


def _usage(turn: Turn, out, output_tokens: int) -> dict:
    cached = out.num_cached_tokens if out is not None else 0
    return {"input_tokens": turn.prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _args(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:  # cut short by max_tokens: the text as it is
        return {"_raw": text}


async def create_message(request: Request) -> Response:
    st = _state(request)
    req: MessagesRequest = await st.read_json(request, MessagesRequest)
    lora = st.resolve_model(req.model)  # a LoRA adapter's name runs under it (start_turn)
    tools = chat_tools(st, req)
    fields = SamplingFields(model=req.model, temperature=req.temperature, top_p=req.top_p,
                            top_k=req.top_k if req.top_k else None, stop=req.stop_sequences or None,
                            response_format=_output_format(req.output_config),
                            structured_outputs=req.structured_outputs)
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    turn = await start_turn(request, st, fields, chat_messages(req), tools, req.max_tokens, bool(req.stream), rid)
    head = {"id": rid, "type": "message", "role": "assistant", "model": lora.name if lora else st.model_name}
    if req.stream:
        return SSEResponse(_events(st, turn, tools, head))
    try:
        out, count = await final_output(request, st, turn)
    except ClientGone:
        return Response(status_code=499)
    parser = tools.parser()
    blocks = ContentBuilder()
    for ev in parser.feed(out.outputs[0].text) + parser.finish():
        blocks.on(ev)
    reason, seq = _stop(out, blocks.has_calls)
    return _json({**head, "content": blocks.blocks, "stop_reason": reason, "stop_sequence": seq,
                  "usage": _usage(turn, out, count)})


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's length, tools included, as rendered for a turn."""
    st = _state(request)
    req: Conversation = await st.read_json(request, Conversation)
    st.resolve_model(req.model)  # an adapter shares the base model's tokenizer
    ids = await chat_tools(st, req).prompt_ids(st, chat_messages(req))
    return _json({"input_tokens": len(ids)})


class ContentBuilder:
    """Content blocks from tool events; :meth:`on` returns the stream events they make."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self.open: int | None = None  # the index of the block being written
        self.calls: dict[int, int] = {}  # the seam's call index -> its block's index

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def on(self, ev: ToolEvent) -> list[dict]:
        if isinstance(ev, (TextDelta, ReasoningDelta)):
            # reasoning (--reasoning-parser) is a thinking block, without a signature: nothing signs it
            kind, field = ("text", "text") if isinstance(ev, TextDelta) else ("thinking", "thinking")
            out = []
            if self.open is None or self.blocks[self.open]["type"] != kind:
                block = {"type": "text", "text": ""} if kind == "text" else \
                    {"type": "thinking", "thinking": "", "signature": ""}
                out = self.stop() + self._start(block)
            self.blocks[self.open][field] += ev.text
            return out + [{"type": "content_block_delta", "index": self.open,
                           "delta": {"type": f"{kind}_delta", field: ev.text}}]
        if isinstance(ev, CallBegin):
            out = self.stop() + self._start({"type": "tool_use", "id": _tool_id(), "name": ev.name, "input": {}})
            self.calls[ev.index] = self.open
            return out
        i = self.calls[ev.index]
        if isinstance(ev, CallArgs):
            return [{"type": "content_block_delta", "index": i,
                     "delta": {"type": "input_json_delta", "partial_json": ev.delta}}]
        assert isinstance(ev, CallEnd)
        self.blocks[i]["input"] = _args(ev.arguments)
        return self.stop() if self.open == i else []

    def _start(self, block: dict) -> list[dict]:
        self.blocks.append(block)
        self.open = len(self.blocks) - 1
        return [{"type": "content_block_start", "index": self.open, "content_block": dict(block)}]

    def stop(self) -> list[dict]:
        i, self.open = self.open, None
        return [] if i is None else [{"type": "content_block_stop", "index": i}]


def _event(obj: dict) -> bytes:
    return b"event: " + obj["type"].encode() + b"\ndata: " + msgspec.json.encode(obj) + b"\n\n"


async def _events(st, turn: Turn, tools: ToolSession, head: dict):
    yield _event({"type": "message_start", "message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": turn.prompt_tokens, "output_tokens": 0}}})
    yield _event({"type": "ping"})
    blocks, tally = ContentBuilder(), Tally()
    try:
        async for ev in tool_events(st, turn, tools, tally):
            for e in blocks.on(ev):
                yield _event(e)
    except APIError as e:
        yield _event(anthropic_body(e))
        return
    for e in blocks.stop():
        yield _event(e)
    last, count = tally.last, tally.tokens
    reason, seq = _stop(last, blocks.has_calls)
    usage = _usage(turn, last, count)
    yield _event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                  "usage": {"output_tokens": count, "input_tokens": usage["input_tokens"],
                            "cache_read_input_tokens": usage["cache_read_input_tokens"]}})
    yield _event({"type": "message_stop"})
