"""Chat outputs parsed the way each model writes them: tool calls in the model's own format
(``--tool-call-parser``) and reasoning spans (``--reasoning-parser``), whole or streamed. Shared by
every chat front end (chat completions, the Responses and Messages APIs, the websocket chat)."""
from __future__ import annotations

from .output import OutputParser, new_call_id, parse_output
from .reasoning import REASONING_FORMATS, ReasoningFormat, reasoning_format
from .tool_formats import TOOL_FORMATS, ToolFormat
from .types import MessageDelta, ParsedMessage, ToolCall, ToolCallDelta

__all__ = ["OutputParser", "parse_output", "new_call_id", "tool_format", "reasoning_format", "TOOL_FORMATS",
           "REASONING_FORMATS", "ToolFormat", "ReasoningFormat", "MessageDelta", "ParsedMessage", "ToolCall",
           "ToolCallDelta"]


def tool_format(name: str, tool_names=None) -> ToolFormat:
    """The format ``name`` (``--tool-call-parser``); ``tool_names`` limits ``json_array``'s calls."""
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool call parser {name!r}: one of {', '.join(TOOL_FORMATS)}")
    cls = TOOL_FORMATS[name]
    return cls(tool_names) if name == "json_array" else cls()
