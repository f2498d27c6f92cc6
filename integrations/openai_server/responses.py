"""OpenAI's Responses API: ``POST /v1/responses`` (streaming or not), ``GET`` and ``DELETE
/v1/responses/{id}``, conversations continued by ``previous_response_id`` (responses_store.py).

A response is one chat turn (chat_turn.py): ``instructions`` become the system message, the input
items chat messages (function calls and their outputs included), function tools and
``tool_choice`` go through the tool seam (tool_adapter.py: chat's template rendering and parsers;
with ``--reasoning-parser`` the reasoning comes first as a ``reasoning`` item), ``text.format``
through structured outputs (after the reasoning span). Its usage reports the prompt tokens the
prefix cache served as ``cached_tokens``.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from .chat_turn import Tally, Turn, final_output, start_turn, tool_events
from .errors import APIError
from .protocol import SamplingFields
from .responses_output import OutputBuilder, assistant_message
from .sse import ClientGone, SSEResponse
from .state import json_response as _json, server_state as _state
from .tool_adapter import ToolSession


class ResponsesRequest(SamplingFields, kw_only=True):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    truncation: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None  # OpenAI's effort/summary: the template and parser decide
    # vLLM's extras, as on chat: template options, and serve --reasoning-parser's budget
    chat_template_kwargs: dict[str, Any] | None = None
    max_reasoning_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None


_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of input_text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS:
            raise APIError(400, f"only text content is supported ({where}[{j}] is {kind!r:.40})",
                           param=f"{where}[{j}]")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """The request's ``input`` as chat messages: messages, ``function_call`` items (joined into the
    assistant turn they belong to) and ``function_call_output`` items (tool turns)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        kind = it.get("type", "message")
        if kind == "message":
            if it.get("role") not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer", param=f"{where}.role")
            out.append({"role": it["role"], "content": _text(it.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args, call_id = it.get("name"), it.get("arguments"), it.get("call_id")
            if not (isinstance(name, str) and isinstance(args, str) and isinstance(call_id, str)):
                raise APIError(400, f"{where} must have name, arguments (a JSON string) and call_id", param=where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise APIError(400, f"{where}.call_id must be a string", param=f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": it["call_id"],
                        "content": _text(it.get("output"), f"{where}.output")})
        elif kind != "reasoning":  # a reasoning item carries nothing the prompt shows
            raise APIError(400, f"{where}.type {kind!r:.40} is not supported (message, function_call, "
                                "function_call_output)", param=f"{where}.type")
    return out


def chat_tools(st, req: ResponsesRequest) -> ToolSession:
    """Responses' flat function tools and tool_choice, in chat's shapes."""
    tools = []
    for i, t in enumerate(req.tools or ()):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise APIError(400, f"tools[{i}]: only function tools ({{'type': 'function', 'name': ...}}) are "
                                f"supported, got type {t.get('type')!r:.40}", param=f"tools[{i}]")
        tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                       if t.get(k) is not None}})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                "'name': ...}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    return ToolSession(st, tools, choice, parallel, chat_template_kwargs=req.chat_template_kwargs,
                       max_reasoning_tokens=req.max_reasoning_tokens)


def _text_format(req: ResponsesRequest) -> None:
    """``text.format`` as chat's ``response_format`` (guided.py reads it from there)."""
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", param="text.format")
    if req.response_format is not None:
        raise APIError(400, "give text.format or response_format, not both", param="response_format")
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r:.40}",
                       param="text.format.type")
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format.schema must be a JSON schema object", param="text.format.schema")
        fmt = {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}
    req.response_format = fmt


def _check(req: ResponsesRequest) -> None:
    if req.background:
        raise APIError(400, "background responses are not supported", param="background")
    if req.truncation not in (None, "disabled"):
        raise APIError(400, "truncation must be 'disabled' (an over-long input is an error)", param="truncation")
    if isinstance(req.input, list) and not req.input and req.previous_response_id is None:
        raise APIError(400, "input must not be empty", param="input")
    _text_format(req)


def _usage(turn: Turn, out, output_tokens: int) -> dict:
    return {"input_tokens": turn.prompt_tokens,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens if out is not None else 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": turn.prompt_tokens + output_tokens}


class _Response:
    """The Response object of one request as it goes from in_progress to its end."""

    def __init__(self, req: ResponsesRequest, rid: str, model: str) -> None:
        self.req = req
        self.obj = {"id": rid, "object": "response", "created_at": time.time(), "status": "in_progress",
                    "error": None, "incomplete_details": None, "instructions": req.instructions,
                    "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
                    "parallel_tool_calls": req.parallel_tool_calls is not False,
                    "previous_response_id": req.previous_response_id, "store": req.store is not False,
                    "temperature": req.temperature, "top_p": req.top_p,
                    "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
                    "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}},
                    "truncation": "disabled", "usage": None, "metadata": req.metadata or {}, "user": req.user}

    def snapshot(self) -> dict:
        return {**self.obj, "output": list(self.obj["output"])}

    def finish(self, items: list[dict], out, usage: dict) -> dict:
        incomplete = out is not None and out.finish_reason == "length"
        self.obj.update(output=items, usage=usage, status="incomplete" if incomplete else "completed",
                        incomplete_details={"reason": "max_output_tokens"} if incomplete else None)
        return self.obj


async def create_response(request: Request) -> Response:
    st = _state(request)
    req: ResponsesRequest = await st.read_json(request, ResponsesRequest)
    lora = st.resolve_model(req.model)  # a LoRA adapter's name runs under it (start_turn)
    _check(req)
    history: list[dict] = []
    if req.previous_response_id is not None:
        prev = st.responses.get(req.previous_response_id)
        if prev is None:
            raise APIError(404, f"Previous response with id '{req.previous_response_id[:100]}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        history = prev.messages
    conversation = history + input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    tools = chat_tools(st, req)
    rid = f"resp_{uuid.uuid4().hex}"
    turn = await start_turn(request, st, req, system + conversation, tools, req.max_output_tokens,
                            bool(req.stream), rid, what="input")
    resp = _Response(req, rid, lora.name if lora else st.model_name)

    def keep(obj: dict, items: list[dict]) -> None:
        if req.store is not False:
            st.responses.put(rid, obj, conversation + [assistant_message(items)])

    if req.stream:
        return SSEResponse(_events(st, turn, tools, resp, keep))
    try:
        out, count = await final_output(request, st, turn)
    except ClientGone:
        return Response(status_code=499)
    builder = OutputBuilder()
    parser = tools.parser()
    for ev in parser.feed(out.outputs[0].text) + parser.finish():
        builder.on(ev)
    builder.close()
    obj = resp.finish(builder.items, out, _usage(turn, out, count))
    keep(obj, builder.items)
    return _json(obj)


def typed_event(obj: dict, seq: int) -> bytes:
    """One server-sent event of a typed stream: ``event: <type>`` and the JSON with its number."""
    return (b"event: " + obj["type"].encode() + b"\ndata: "
            + msgspec.json.encode({**obj, "sequence_number": seq}) + b"\n\n")


async def _events(st, turn: Turn, tools: ToolSession, resp: _Response, keep):
    seq = 0

    def send(obj: dict) -> bytes:
        nonlocal seq
        seq += 1
        return typed_event(obj, seq - 1)

    yield send({"type": "response.created", "response": resp.snapshot()})
    yield send({"type": "response.in_progress", "response": resp.snapshot()})
    builder, tally = OutputBuilder(), Tally()
    try:
        async for ev in tool_events(st, turn, tools, tally):
            for e in builder.on(ev):
                yield send(e)
    except APIError as e:
        yield send({"type": "error", "code": e.code or e.type, "message": e.message, "param": e.param})
        return
    for e in builder.close():
        yield send(e)
    obj = resp.finish(builder.items, tally.last, _usage(turn, tally.last, tally.tokens))
    keep(obj, builder.items)
    # response.completed also when the status is "incomplete" (as vLLM): the openai client's stream
    # helper knows no other end
    yield send({"type": "response.completed", "response": obj})


async def get_response(request: Request) -> Response:
    st = _state(request)
    rid = request.path_params["response_id"]
    stored = st.responses.get(rid)
    if stored is None:
        raise APIError(404, f"Response with id '{rid[:100]}' not found.", param="response_id", code="not_found")
    return _json(stored.response)


async def delete_response(request: Request) -> Response:
    st = _state(request)
    rid = request.path_params["response_id"]
    if not st.responses.delete(rid):
        raise APIError(404, f"Response with id '{rid[:100]}' not found.", param="response_id", code="not_found")
    return _json({"id": rid, "object": "response", "deleted": True})
