"""Reading calls written as JSON objects (``{"name": ..., "arguments": {...}}``) out of a text that
may still be growing: what is known so far of each call (its name once whole, its arguments' text
as far as written), so a stream can send a call's name first and its arguments piece by piece.

The arguments are streamed as the model wrote them (the joined pieces are the exact JSON text of
the object); a whole message carries them re-encoded (``json.dumps``), as vLLM's parsers do."""
from __future__ import annotations

import json
import re

import msgspec

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_WS = " \t\r\n"


class PartialCall(msgspec.Struct, kw_only=True):
    """A call as far as the text shows it: ``args`` is its arguments' JSON text so far (complete
    once ``args_done``); ``done``: the call's own text has ended."""

    name: str | None = None
    args: str = ""
    args_done: bool = False
    done: bool = False


def value_end(text: str, i: int) -> int | None:
    """Where the JSON value starting at ``text[i]`` ends, or None while it is incomplete (or bad)."""
    try:
        return _DECODER.raw_decode(text, i)[1]
    except ValueError:
        return None


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def normalized(args: str) -> str | None:
    """A call's arguments as a whole message carries them: the object re-encoded (None: not an object)."""
    try:
        obj = json.loads(args) if args.strip() else {}
    except ValueError:
        return None
    return json.dumps(obj, ensure_ascii=False) if isinstance(obj, dict) else None


def call_object(text: str, i: int) -> tuple[PartialCall | None, int | None]:
    """The call object starting at ``text[i]`` (a ``{``): (what is known of it, where it ends or
    None while incomplete). (None, end): a complete object that is not a call."""
    end = value_end(text, i)
    if end is not None:
        try:
            obj = json.loads(text[i:end])
        except ValueError:
            return None, end
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, end
        args_obj = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args_obj, dict):
            return None, end
        m = _ARGS.search(text, i, end)
        args = ""
        if m is not None and text.startswith("{", m.end()):
            a_end = value_end(text, m.end())
            args = text[m.end():a_end] if a_end is not None else ""
        if not args:
            args = json.dumps(args_obj, ensure_ascii=False)
        return PartialCall(name=obj["name"], args=args, args_done=True, done=True), end
    call = PartialCall()
    m = _ARGS.search(text, i)
    name = _NAME.search(text, i, m.start() if m is not None else len(text))
    if name is not None:
        try:
            call.name = json.loads(f'"{name.group(1)}"')
        except ValueError:
            pass
    if m is not None and text.startswith("{", m.end()):
        a_end = value_end(text, m.end())
        call.args = text[m.end():a_end] if a_end is not None else text[m.end():]
        call.args_done = a_end is not None
    return call, None


def call_array(text: str, i: int) -> tuple[list[PartialCall], bool, int | None]:
    """The JSON array of call objects starting at ``text[i]`` (a ``[``): (calls so far, well formed
    so far, where the array ends or None)."""
    calls: list[PartialCall] = []
    i = skip_ws(text, i + 1)
    if text.startswith("]", i):
        return calls, True, i + 1
    while i < len(text):
        if text[i] != "{":
            return calls, False, None
        call, end = call_object(text, i)
        if call is None:
            return calls, end is None, None
        calls.append(call)
        if end is None:
            return calls, True, None
        i = skip_ws(text, end)
        if i >= len(text):
            return calls, True, None
        if text[i] == "]":
            return calls, True, i + 1
        if text[i] != ",":
            return calls, False, None
        i = skip_ws(text, i + 1)
    return calls, True, None
