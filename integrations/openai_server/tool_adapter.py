"""The one seam between the Responses / Messages endpoints and tool calling: how a request's tools
reach the prompt and the grammar, and how the model's text becomes calls, as a stream of events.

Today this wraps ``integrations/tool_calls.py`` (the tools described in a system message, calls
written as one JSON array). Swapping in per-model parsers (``--tool-call-parser``) changes this
module only: the endpoints see :class:`ToolSession` and the events below, never a format.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import msgspec

from asyncengine.engine.validation import RequestLimitError

from ..tool_calls import ToolPlan
from .errors import APIError
from .protocol import ChatMessage


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallBegin:
    index: int
    name: str


@dataclass(frozen=True, slots=True)
class CallArgs:
    index: int
    delta: str


@dataclass(frozen=True, slots=True)
class CallEnd:
    index: int
    arguments: str  # the whole arguments JSON


ToolEvent = TextDelta | CallBegin | CallArgs | CallEnd


class ToolSession:
    """One request's tools. ``tools``: OpenAI chat-format tools; ``tool_choice``: "none", "auto",
    "required" or ``{"type": "function", "function": {"name": ...}}``; bad shapes are a 400
    naming ``param`` (the field of the calling API)."""

    def __init__(self, tools: list[dict] | None, tool_choice, parallel: bool | None, param: str = "tools") -> None:
        try:
            self.plan = ToolPlan(tools, tool_choice, parallel)
        except RequestLimitError as e:
            raise APIError(400, str(e), param=e.param or param) from None

    @property
    def active(self) -> bool:
        return self.plan.mode != "none"

    def structured(self):
        """The grammar a forced call (required, named) is sampled under, or None."""
        return self.plan.structured()

    async def prompt_ids(self, st, messages: list[dict]) -> list[int]:
        """The chat prompt's token ids: ``messages`` are OpenAI chat messages (``tool_calls`` on
        assistant turns, ``tool`` turns with ``tool_call_id``), the tools rendered with them."""
        try:
            structs = msgspec.convert(messages, list[ChatMessage])
        except msgspec.ValidationError as e:
            raise APIError(400, f"invalid message: {e}", param="messages") from None
        return await st.chat_prompt(structs, self.plan.prompt())

    def parser(self) -> "CallStream":
        return CallStream(self.plan)


class CallStream:
    """The model's text, fed as it comes, as :data:`ToolEvent` s. Plain text streams at once;
    text that may be a call (it opens with ``[`` or ``{`` under "auto", or any forced output) is
    held until the end and parsed whole, except a named tool's output, which is that tool's
    arguments by construction and streams as argument fragments."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.buf = ""
        self.held: bool | None = None  # None: undecided (only whitespace so far)
        self.began = False

    def feed(self, text: str) -> list[ToolEvent]:
        if not text:
            return []
        mode = self.plan.mode
        if mode == "none":
            return [TextDelta(text)]
        if mode == "named":
            self.buf += text
            out: list[ToolEvent] = [] if self.began else [CallBegin(0, self.plan.named)]
            self.began = True
            return out + [CallArgs(0, text)]
        self.buf += text
        if self.held is None:
            head = self.buf.lstrip()
            if not head:
                return []
            self.held = mode == "required" or head[0] in "[{"
            if not self.held:
                text, self.buf = self.buf, ""
                return [TextDelta(text)]
            return []
        if self.held:
            return []
        self.buf = ""
        return [TextDelta(text)]

    def finish(self) -> list[ToolEvent]:
        """The events the end of the output releases (held text parsed as calls, or as text)."""
        mode = self.plan.mode
        if mode == "named":
            if not self.began:
                return []
            return [CallEnd(0, self.buf)]
        if not self.buf:
            return []
        text, self.buf = self.buf, ""
        calls = self.plan.calls(text) if mode != "none" else None
        if not calls:
            return [TextDelta(text)]
        out: list[ToolEvent] = []
        for i, c in enumerate(calls):
            args = json.dumps(c["arguments"], ensure_ascii=False)
            out += [CallBegin(i, c["name"]), CallArgs(i, args), CallEnd(i, args)]
        return out
