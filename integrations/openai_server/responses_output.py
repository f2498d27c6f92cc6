"""The Responses API's output: tool events (tool_adapter.py) made into output items (``reasoning``
with a ``reasoning_text`` part, ``message`` with ``output_text`` parts, ``function_call``) and,
when streaming, into the typed events clients expect (``response.output_item.added`` ...
``response.output_item.done``), in their order."""
from __future__ import annotations

import uuid

from .tool_adapter import CallArgs, CallBegin, CallEnd, ReasoningDelta, TextDelta, ToolEvent


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# item type -> (id prefix, content part type, event prefix, the part's and events' extra fields)
_TEXT_ITEMS = {
    "message": ("msg", "output_text", "response.output_text", {"logprobs": []}),
    "reasoning": ("rs", "reasoning_text", "response.reasoning_text", {}),
}


class OutputBuilder:
    """Builds the ``output`` list; :meth:`on` and :meth:`close` return the stream events (without
    ``sequence_number``, which the sender numbers). Reasoning (``--reasoning-parser``) is a
    ``reasoning`` item with one ``reasoning_text`` part, streamed as ``response.reasoning_text.*``."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None  # the message or reasoning item being written
        self._calls: dict[int, dict] = {}  # adapter call index -> its function_call item

    def on(self, ev: ToolEvent) -> list[dict]:
        if isinstance(ev, (TextDelta, ReasoningDelta)):
            kind = "message" if isinstance(ev, TextDelta) else "reasoning"
            out = self._open_item(kind)
            part = self._open["content"][0]
            part["text"] += ev.text
            return out + [{"type": _TEXT_ITEMS[kind][2] + ".delta", "item_id": self._open["id"],
                           "output_index": len(self.items) - 1, "content_index": 0, "delta": ev.text,
                           **_TEXT_ITEMS[kind][3]}]
        if isinstance(ev, CallBegin):
            out = self._close_item()
            item = {"type": "function_call", "id": _id("fc"), "call_id": ev.id or _id("call"), "name": ev.name,
                    "arguments": "", "status": "in_progress"}
            self.items.append(item)
            self._calls[ev.index] = item
            return out + [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                           "item": dict(item)}]
        item = self._calls[ev.index]
        index = self.items.index(item)
        if isinstance(ev, CallArgs):
            item["arguments"] += ev.delta
            return [{"type": "response.function_call_arguments.delta", "item_id": item["id"],
                     "output_index": index, "delta": ev.delta}]
        assert isinstance(ev, CallEnd)
        item["arguments"] = ev.arguments
        item["status"] = "completed"
        return [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                 "name": item["name"], "arguments": ev.arguments},
                {"type": "response.output_item.done", "output_index": index, "item": dict(item)}]

    def close(self) -> list[dict]:
        """End of output: the open item is closed (an output with no answer gets an empty message)."""
        out = [] if any(it["type"] != "reasoning" for it in self.items) else self._open_item("message")
        return out + self._close_item()

    def _open_item(self, kind: str) -> list[dict]:
        if self._open is not None and self._open["type"] == kind:
            return []
        out = self._close_item()
        prefix, part_type, _, extra = _TEXT_ITEMS[kind]
        part = {"type": part_type, "text": "", **({"annotations": []} if kind == "message" else {}), **extra}
        if kind == "message":
            self._open = {"type": "message", "id": _id(prefix), "status": "in_progress", "role": "assistant",
                          "content": [part]}
        else:
            self._open = {"type": "reasoning", "id": _id(prefix), "summary": [], "content": [part],
                          "status": "in_progress"}
        self.items.append(self._open)
        index = len(self.items) - 1
        return out + [{"type": "response.output_item.added", "output_index": index,
                       "item": {**self._open, "content": []}},
                      {"type": "response.content_part.added", "item_id": self._open["id"], "output_index": index,
                       "content_index": 0, "part": dict(part)}]

    def _close_item(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = self.items.index(item)
        part = item["content"][0]
        _, _, events, extra = _TEXT_ITEMS[item["type"]]
        return [{"type": events + ".done", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "text": part["text"], **extra},
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": index, "item": item}]


def assistant_message(items: list[dict]) -> dict:
    """The output as one chat message for the conversation's next turn."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return msg
