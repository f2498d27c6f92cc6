"""The Responses API's output: tool events (tool_adapter.py) made into output items (``message``
with ``output_text`` parts, ``function_call``) and, when streaming, into the typed events clients
expect (``response.output_item.added`` ... ``response.output_item.done``), in their order."""
from __future__ import annotations

import uuid

from .tool_adapter import CallArgs, CallBegin, CallEnd, TextDelta, ToolEvent


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Builds the ``output`` list; :meth:`on` and :meth:`close` return the stream events (without
    ``sequence_number``, which the sender numbers)."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._msg: dict | None = None  # the message item being written
        self._calls: dict[int, dict] = {}  # adapter call index -> its function_call item

    def on(self, ev: ToolEvent) -> list[dict]:
        if isinstance(ev, TextDelta):
            out = self._open_message()
            part = self._msg["content"][0]
            part["text"] += ev.text
            return out + [{"type": "response.output_text.delta", "item_id": self._msg["id"],
                           "output_index": len(self.items) - 1, "content_index": 0, "delta": ev.text,
                           "logprobs": []}]
        if isinstance(ev, CallBegin):
            out = self._close_message()
            item = {"type": "function_call", "id": _id("fc"), "call_id": _id("call"), "name": ev.name,
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
        """End of output: the open message is closed (an output with no item gets an empty one)."""
        out = [] if self.items else self._open_message()
        return out + self._close_message()

    def _open_message(self) -> list[dict]:
        if self._msg is not None:
            return []
        self._msg = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                     "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.items.append(self._msg)
        index = len(self.items) - 1
        return [{"type": "response.output_item.added", "output_index": index,
                 "item": {**self._msg, "content": []}},
                {"type": "response.content_part.added", "item_id": self._msg["id"], "output_index": index,
                 "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [],
                                              "logprobs": []}}]

    def _close_message(self) -> list[dict]:
        msg, self._msg = self._msg, None
        if msg is None:
            return []
        msg["status"] = "completed"
        index = self.items.index(msg)
        part = msg["content"][0]
        return [{"type": "response.output_text.done", "item_id": msg["id"], "output_index": index,
                 "content_index": 0, "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", "item_id": msg["id"], "output_index": index,
                 "content_index": 0, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": index, "item": msg}]


def assistant_message(items: list[dict]) -> dict:
    """The output as one chat message for the conversation's next turn."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return msg
