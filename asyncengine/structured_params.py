"""StructuredOutputsParams (vLLM's fields): exactly one of json / json_object / regex / choice /
grammar; and, for reasoning models, where the grammar starts (``after``: once the output has
written the end of its reasoning span) and how long that span may be (``reasoning_budget``)."""
from __future__ import annotations

import json as _json
from typing import Any

import msgspec

from asyncengine.errors import InvalidRequestError


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    json: str | dict[str, Any] | None = None  # a JSON schema (text or object)
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style, xgrammar's dialect), start rule "root"
    # JSON: a compact form by default (no free whitespace between tokens): a model cannot pad its
    # output with whitespace runs until it hits max_tokens. True allows any whitespace.
    any_whitespace: bool = False
    # set by the front end's compile service (compile_service.py), never by callers: xgrammar's
    # serialized grammar (zlib-packed), so that an engine core in another process deserializes it
    # instead of compiling inside its step loop. Not part of ``key``.
    compiled: bytes | None = None
    # reasoning models: the token ids that end a reasoning span (e.g. "</think>"). The grammar
    # applies only after the output has written them; before, every token is allowed. Without a
    # grammar kind, only the budget below applies.
    after: list[int] | None = None
    # at most this many output tokens before ``after``: then ``after`` is forced (needs ``after``)
    reasoning_budget: int | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, n)]
        if self.after is not None and (not self.after or len(self.after) > 16 or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.after)):
            raise InvalidRequestError("structured_outputs.after: 1 to 16 token ids")
        if self.reasoning_budget is not None and (self.after is None or self.reasoning_budget < 0):
            raise InvalidRequestError("structured_outputs.reasoning_budget: a count >= 0, with 'after'")
        if not given and self.after is not None:
            return  # a reasoning span's bounds alone
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs: give exactly one of json, json_object, regex, "
                                      f"choice, grammar (got {given or 'none'})")
        if self.choice is not None and not all(isinstance(c, str) and c for c in self.choice):
            raise InvalidRequestError("structured_outputs.choice: a list of non-empty strings")

    @property
    def has_grammar(self) -> bool:
        return any(getattr(self, n) for n in ("json", "json_object", "regex", "choice", "grammar"))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what a compiled grammar is cached by."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else _json.dumps(self.json)  # property order matters
            return ("json_ws" if self.any_whitespace else "json", text)
        if self.json_object:
            return ("json_object_ws" if self.any_whitespace else "json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", _json.dumps(self.choice))
        return ("grammar", self.grammar)
