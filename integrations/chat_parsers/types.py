"""What a chat output parses into, whole or streamed: the shapes every front end (chat
completions, Responses, Messages, the websocket) turns into its own wire format."""
from __future__ import annotations

import msgspec


class ToolCall(msgspec.Struct, kw_only=True):
    """One parsed call: ``arguments`` is JSON text (an object), as OpenAI sends it."""

    id: str
    name: str
    arguments: str


class ParsedMessage(msgspec.Struct, kw_only=True):
    """A whole output split: the reasoning span, the answer text and the calls (None / [] when absent)."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of call ``index``: its first piece carries ``id`` and ``name``; the ``arguments``
    pieces of one call, joined in order, are its arguments' JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class MessageDelta(msgspec.Struct, kw_only=True):
    """What one step of a stream adds ("" / [] = nothing of that kind)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = msgspec.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)
