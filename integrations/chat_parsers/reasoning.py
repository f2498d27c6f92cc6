"""Reasoning spans (``<think> ... </think>``) split from the answer, named as vLLM's
``--reasoning-parser`` names them.

* ``deepseek_r1``: the template opens ``<think>`` in the prompt (the model may write it again); all
  text up to ``</think>`` is reasoning; an output without ``</think>`` is reasoning cut short.
* ``qwen3``: the same, except when thinking is switched off (``chat_template_kwargs``
  ``{"enable_thinking": false}``: the template closes an empty span in the prompt): then an output
  the output is all answer.

A split is computed from the text so far (``split``); a stream sends what each call adds. Text that
could be the start of ``</think>`` (``"</thi"`` at the end) is held back until it is told apart, so a
marker that falls across chunks or tokens never leaks into either side.
"""
from __future__ import annotations

from typing import NamedTuple

from .tool_formats import held_tail


class Split(NamedTuple):
    reasoning: str
    content_start: int | None  # where the answer begins in the text (None: still reasoning)


class ReasoningFormat:
    name = ""
    START, END = "<think>", "</think>"

    def __init__(self, thinking: bool = True) -> None:
        self.thinking = thinking

    def split(self, text: str, final: bool) -> Split:
        """The reasoning so far (stable: only grows as text is added) and where the answer begins."""
        if not self.thinking:
            return Split("", 0)
        begin = 0
        lead = len(text) - len(text.lstrip())
        if text.startswith(self.START, lead):
            begin = lead + len(self.START)
        elif not final and self.START.startswith(text[lead:]) and len(text) > lead:
            return Split("", None)  # may be "<think>" coming
        end = text.find(self.END, begin)
        if end >= 0:
            return Split(text[begin:end], end + len(self.END))
        return Split(text[begin:len(text) - (0 if final else held_tail(text, (self.END,)))], None)


class DeepSeekR1(ReasoningFormat):
    name = "deepseek_r1"


class Qwen3(ReasoningFormat):
    name = "qwen3"

    def __init__(self, thinking: bool = True, chat_template_kwargs: dict | None = None) -> None:
        kw = chat_template_kwargs or {}
        super().__init__(thinking and kw.get("enable_thinking", True) is not False)


REASONING_FORMATS: dict[str, type[ReasoningFormat]] = {f.name: f for f in (DeepSeekR1, Qwen3)}


def reasoning_format(name: str, chat_template_kwargs: dict | None = None) -> ReasoningFormat:
    if name not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}: one of {', '.join(REASONING_FORMATS)}")
    if name == "qwen3":
        return Qwen3(chat_template_kwargs=chat_template_kwargs)
    return REASONING_FORMATS[name]()
