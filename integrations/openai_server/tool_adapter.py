"""The one seam between the Responses / Messages endpoints and chat's tools and reasoning: how a
request's tools reach the prompt and the grammar, and how the model's text becomes reasoning, text
and calls, as a stream of events.

It is chat's own path (chat.py's :class:`ChatPlan`: the tools rendered through the model's chat
template, the output read by the server's ``--tool-call-parser`` and ``--reasoning-parser``, the
JSON-array format when no parser is configured), so every front end reads a model the same way; the
endpoints see :class:`ToolSession` and the events below, never a format.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from ..chat_parsers import MessageDelta, OutputParser
from .chat import ChatPlan
from .errors import APIError
from .protocol import ChatMessage


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallBegin:
    index: int
    name: str
    id: str = ""  # the parser's call id (its format's style: Mistral's templates want 9 alphanumerics)


@dataclass(frozen=True, slots=True)
class CallArgs:
    index: int
    delta: str


@dataclass(frozen=True, slots=True)
class CallEnd:
    index: int
    arguments: str  # the whole arguments JSON (the call's argument pieces joined)


ToolEvent = ReasoningDelta | TextDelta | CallBegin | CallArgs | CallEnd


@dataclass(slots=True)
class _Request:
    """What :class:`ChatPlan` reads of a request, in chat's shapes."""

    tools: list[dict] | None
    tool_choice: Any
    parallel_tool_calls: bool | None
    chat_template_kwargs: dict | None = None
    max_reasoning_tokens: int | None = None


class ToolSession:
    """One request's tools and template options. ``tools``: OpenAI chat-format tools;
    ``tool_choice``: "none", "auto", "required" or ``{"type": "function", "function": {"name": ...}}``;
    bad shapes are a 400 naming the field (``param`` when the check names none)."""

    def __init__(self, st, tools: list[dict] | None, tool_choice, parallel: bool | None, param: str = "tools",
                 chat_template_kwargs: dict | None = None, max_reasoning_tokens: int | None = None) -> None:
        try:
            self.plan = ChatPlan(st, _Request(tools, tool_choice, parallel, chat_template_kwargs,
                                              max_reasoning_tokens))
        except APIError as e:
            if e.param is None:
                e.param = param
            raise

    @property
    def active(self) -> bool:
        return self.plan.tools.mode != "none"

    def check_generation(self) -> None:
        """Chat's rule for generating with these tools ("auto" needs --enable-auto-tool-choice
        where the server reads a model's own format)."""
        self.plan.check_generation()

    def structured(self):
        """The grammar a forced call (required, named) is sampled under, or None."""
        return self.plan.tools.structured()

    def gate(self, st, params):
        """``params`` with its grammar held back until the reasoning span ends (chat's rule)."""
        return self.plan.reasoning_gate(st, params)

    async def prompt_ids(self, st, messages: list[dict]) -> list[int]:
        """The chat prompt's token ids: ``messages`` are OpenAI chat messages (``tool_calls`` on
        assistant turns, ``tool`` turns with ``tool_call_id``), the tools rendered with them."""
        try:
            structs = msgspec.convert(messages, list[ChatMessage])
        except msgspec.ValidationError as e:
            raise APIError(400, f"invalid message: {e}", param="messages") from None
        return await self.plan.prompt(st, structs)

    def parser(self) -> "EventStream":
        return EventStream(self.plan.parser())


class EventStream:
    """The model's text, fed as it comes, as :data:`ToolEvent` s: chat's parser's deltas (reasoning,
    text, a call's name then its argument pieces), and at the end one :class:`CallEnd` per call."""

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.args: dict[int, str] = {}  # call index -> its argument pieces so far

    def feed(self, text: str) -> list[ToolEvent]:
        return self._events(self.parser.feed(text)) if text else []

    def finish(self) -> list[ToolEvent]:
        """The events the end of the output releases (held text, then every call's end)."""
        out = self._events(self.parser.finish())
        return out + [CallEnd(i, self.args[i]) for i in sorted(self.args)]

    def _events(self, d: MessageDelta) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if d.reasoning:
            out.append(ReasoningDelta(d.reasoning))
        if d.content:
            out.append(TextDelta(d.content))
        for tc in d.tool_calls:
            if tc.name is not None:
                self.args[tc.index] = ""
                out.append(CallBegin(tc.index, tc.name, tc.id or ""))
            if tc.arguments:
                self.args[tc.index] += tc.arguments
                out.append(CallArgs(tc.index, tc.arguments))
        return out
