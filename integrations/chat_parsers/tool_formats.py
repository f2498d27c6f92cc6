"""Each model family's tool-call format, named as vLLM's ``--tool-call-parser`` names it.

A format reads an output that may still be growing (``scan``) and says which leading part of it is
plain text for sure (``content_end``: text that could still turn out to open a call is held back)
and what is known of each call so far. The same scan serves a stream (called as text arrives) and
a whole message (``final=True``: nothing is held back; a text that is not well-formed calls is
plain content, as vLLM's parsers answer).

Formats (what the model writes; see each model's chat template):

* ``hermes`` (Qwen2.5, Qwen3, Hermes): text, then ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  blocks; the text before the first block is the content.
* ``mistral``: text, then ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (or the newer
  ``[TOOL_CALLS]name[ARGS]{...}``, repeated).
* ``llama3_json`` (Llama 3.1-3.3): the output is ``{"name": ..., "parameters": {...}}`` objects
  separated by ``;``, optionally after ``<|python_tag|>``.
* ``granite``: ``<|tool_call|>`` (or ``<tool_call>``) and a JSON array of calls.
* ``pythonic`` (Llama 3.2/4, ToolACE): the output is a Python list of calls ``[f(a=1), g(b="x")]``.
* ``json_array``: this project's own, for templates without tools: the output is the JSON array
  ``[{"name": ..., "arguments": {...}}]`` (or one such object); only calls of known tools count.
"""
from __future__ import annotations

import ast
import json
import re
from typing import NamedTuple

from .json_calls import PartialCall, call_array, call_object, skip_ws, value_end


class Scan(NamedTuple):
    content_end: int  # text[:content_end] is plain text for sure
    calls: list[PartialCall]
    ok: bool  # False: not well-formed calls (final: the whole text is content)


def held_tail(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters could be the start of a marker (held back while streaming)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def _content_before(text: str, markers: tuple[str, ...], final: bool) -> tuple[int, int, str | None]:
    """(content end, where the first marker starts or -1, that marker)."""
    found = [(text.find(m), m) for m in markers if m in text]
    if found:
        at, m = min(found)
        return at, at, m
    return len(text) - (0 if final else held_tail(text, markers)), -1, None


class ToolFormat:
    name = ""
    call_id_style = "openai"  # "mistral": 9 alphanumeric characters, as Mistral's templates require

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError


class Hermes(ToolFormat):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        content_end, at, _ = _content_before(text, (self.START,), final)
        calls: list[PartialCall] = []
        while at >= 0:
            i = skip_ws(text, at + len(self.START))
            if i >= len(text):
                break
            if text[i] != "{":
                return Scan(content_end, calls, False)
            call, end = call_object(text, i)
            if call is None:
                return Scan(content_end, calls, end is None and not final)
            calls.append(call)
            if end is None:
                return Scan(content_end, calls, not final)
            after = skip_ws(text, end)
            if text.startswith(self.END, after):
                after += len(self.END)
            elif after < len(text) and not self.END.startswith(text[after:]):
                return Scan(content_end, calls, False)
            at = text.find(self.START, after)
        return Scan(content_end, calls, bool(calls) or not final)


class Mistral(ToolFormat):
    name = "mistral"
    call_id_style = "mistral"
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")

    def scan(self, text: str, final: bool) -> Scan:
        content_end, at, _ = _content_before(text, (self.START,), final)
        if at < 0:
            return Scan(content_end, [], not final)
        i = skip_ws(text, at + len(self.START))
        if text.startswith("[", i):
            calls, ok, end = call_array(text, i)
            return Scan(content_end, calls, ok and (end is not None or not final) and (bool(calls) or not final))
        calls: list[PartialCall] = []
        while i < len(text):  # name[ARGS]{...} (or name{...}), each after a [TOOL_CALLS]
            m = self._NAME.match(text, i)
            if m is None:
                return Scan(content_end, calls, False)
            j = m.end()
            if text.startswith(self.ARGS, j):
                j += len(self.ARGS)
            elif j == len(text) or self.ARGS.startswith(text[j:]):
                break  # the name may go on
            if j >= len(text):
                break
            if text[j] != "{":
                return Scan(content_end, calls, False)
            end = value_end(text, j)
            calls.append(PartialCall(name=m.group(0), args=text[j:end] if end else text[j:],
                                     args_done=end is not None, done=end is not None))
            if end is None:
                break
            i = skip_ws(text, end)
            if text.startswith(self.START, i):
                i += len(self.START)
            elif i < len(text) and not self.START.startswith(text[i:]):
                return Scan(content_end, calls, False)
        return Scan(content_end, calls, bool(calls) and calls[-1].done or not final)


class _AtStart(ToolFormat):
    """Formats whose calls are the whole output: it is content unless it starts like calls."""

    PREFIXES: tuple[str, ...] = ()
    OPENERS = "{["

    def start(self, text: str, final: bool) -> tuple[int, int | None]:
        """(content end, where the calls begin or None)."""
        i = skip_ws(text, 0)
        rest = text[i:]
        for p in self.PREFIXES:
            if rest.startswith(p):
                return 0, skip_ws(text, i + len(p))
        if not rest or (not final and any(p.startswith(rest) for p in self.PREFIXES)):
            return 0, None
        if rest[0] in self.OPENERS:
            return 0, i
        return len(text), None

    def scan(self, text: str, final: bool) -> Scan:
        content_end, i = self.start(text, final)
        if i is None:
            return Scan(content_end, [], content_end == len(text) and not final)
        if i >= len(text):
            return Scan(0, [], not final)
        calls, ok = self.calls(text, i, final)
        return Scan(0, calls, ok)

    def calls(self, text: str, i: int, final: bool) -> tuple[list[PartialCall], bool]:
        raise NotImplementedError


class Llama3Json(_AtStart):
    name = "llama3_json"
    PREFIXES = ("<|python_tag|>",)
    OPENERS = "{"

    def calls(self, text: str, i: int, final: bool) -> tuple[list[PartialCall], bool]:
        calls: list[PartialCall] = []
        while i < len(text):
            if text[i] != "{":
                return calls, False
            call, end = call_object(text, i)
            if call is None:
                return calls, end is None and not final
            calls.append(call)
            if end is None:
                return calls, not final
            i = skip_ws(text, end)
            if i < len(text):
                if text[i] != ";":
                    return calls, False
                i = skip_ws(text, i + 1)
        return calls, bool(calls) and calls[-1].done or not final


class Granite(_AtStart):
    name = "granite"
    PREFIXES = ("<|tool_call|>", "<tool_call>")
    OPENERS = "["

    def calls(self, text: str, i: int, final: bool) -> tuple[list[PartialCall], bool]:
        if text[i] != "[":
            return [], False
        calls, ok, end = call_array(text, i)
        return calls, ok and (end is not None or not final)


class JsonArray(_AtStart):
    name = "json_array"

    def __init__(self, tool_names=None) -> None:
        self.tool_names = set(tool_names) if tool_names is not None else None

    def calls(self, text: str, i: int, final: bool) -> tuple[list[PartialCall], bool]:
        if text[i] == "{":
            call, end = call_object(text, i)
            calls, ok = ([call] if call else []), call is not None or end is None
            ok = ok and (end is not None or not final)
        else:
            calls, ok, end = call_array(text, i)
            ok = ok and (end is not None or not final) and (bool(calls) or not final)
        if self.tool_names is not None and any(c.name is not None and c.name not in self.tool_names
                                               for c in calls):
            return [], False
        return calls, ok


class Pythonic(_AtStart):
    name = "pythonic"
    OPENERS = "["

    def calls(self, text: str, i: int, final: bool) -> tuple[list[PartialCall], bool]:
        try:
            tree = ast.parse(text[i:].strip(), mode="eval")
        except SyntaxError:
            return [], not final  # incomplete (or not Python): nothing yet
        if not isinstance(tree.body, ast.List):
            return [], False
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return [], False
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                return [], False
            if None in args:
                return [], False
            calls.append(PartialCall(name=node.func.id, args=json.dumps(args, ensure_ascii=False),
                                     args_done=True, done=True))
        return calls, bool(calls)


TOOL_FORMATS: dict[str, type[ToolFormat]] = {
    f.name: f for f in (Hermes, Mistral, Llama3Json, Granite, Pythonic, JsonArray)}
