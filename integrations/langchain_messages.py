"""LangChain messages to the engine's chat messages (integrations/langchain.py): text parts, tool
calls written back in the format the model is asked to call in, tool results as ``tool`` turns, and
images (a model that takes them: integrations/chat_images.py)."""
from __future__ import annotations

from collections.abc import Sequence

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage

from .chat_images import image_from_base64, image_from_url
from .tool_calls import assistant_turn


def _image(part: dict) -> str:
    """A LangChain image content block as a data URL: OpenAI's ``{"type": "image_url", "image_url":
    {"url": ...}}`` or LangChain's standard ``{"type": "image", "base64" | "url": ...}`` (and its
    older ``source_type``/``data`` spelling)."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return image_from_url(url.get("url") if isinstance(url, dict) else url)
    if part.get("base64") or part.get("source_type") == "base64":
        return image_from_base64(part.get("base64") or part.get("data"), part.get("mime_type"))
    return image_from_url(part.get("url") or part.get("data"))


def _text(content, images: list | None = None, image_token: str | None = None) -> str:
    """A message's text: a string, or the text parts of a content list (tool-use parts are carried
    by ``tool_calls``); with ``image_token`` (a model that takes images) each image part becomes it
    and its data URL joins ``images``; anything else (audio, files) is refused."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content or ():
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            parts.append(part.get("text") or "")
        elif isinstance(part, dict) and part.get("type") in ("tool_use", "tool_call", "function_call"):
            continue
        elif isinstance(part, dict) and part.get("type") in ("image_url", "image") and image_token is not None:
            images.append(_image(part))
            parts.append(image_token)
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"only text content is supported by this model, not {kind!r}")
    return "\n".join(parts)


def to_engine_messages(messages: Sequence[BaseMessage], images: list | None = None,
                       image_token: str | None = None) -> list[dict]:
    """LangChain messages -> the engine's chat messages. Earlier tool calls are written back in the
    format the model is asked to call in (``tool_calls.assistant_turn``); tool results are ``tool`` turns.
    Images in user messages (a model with ``image_token``): the token in the text, the data in ``images``."""
    out = []
    for m in messages:
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": _text(m.content)})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": _text(m.content, images, image_token)})
        elif isinstance(m, AIMessage):
            out.append(assistant_turn(_text(m.content), [{"name": c["name"], "arguments": c["args"]}
                                                           for c in m.tool_calls]))
        elif isinstance(m, ToolMessage):
            out.append({"role": "tool", "content": _text(m.content)})
        elif isinstance(m, ChatMessage):
            out.append({"role": m.role, "content": _text(m.content)})
        else:
            raise ValueError(f"unsupported message type {type(m).__name__}")
    return out
