"""What one structured-output request may cost, and the cheap checks that refuse a grammar before
it is compiled.

Compiling is where a hostile request hurts: xgrammar's cost grows with regex repetition bounds
(``[a-z]{1,10000}``: 12.7 s with the default model's tokenizer), enum sizes (10,000 values: 22 s)
and alternations, while the request itself is a few hundred bytes (issue 27's measurements). So a
request is first checked here, in microseconds, against the limits of :class:`GrammarLimits`;
what passes is compiled by the compile service (``compile_service.py``) within ``max_grammar_compile_s``.
Every refusal is a :class:`GrammarLimitError` (an ``InvalidRequestError``: HTTP 400) naming the
limit and its flag.
"""
from __future__ import annotations

import json as _json
from typing import Any

import msgspec

from asyncengine.errors import ConfigError, InvalidRequestError


class GrammarLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request limits of structured outputs (each has a ``serve`` flag of the same name, with
    dashes). The defaults let through every schema of the structured-output tests and what real
    tool/response schemas look like, and refuse the patterns of issue 27 before they compile.

    * ``max_grammar_compile_s``: compile time of one grammar (its own worker process is killed past it).
    * ``max_grammar_bytes``: the schema / regex / grammar text (or the choices, JSON-encoded).
    * ``max_schema_depth``: nesting of a JSON schema's objects and arrays.
    * ``max_enum_values``: ``enum`` values plus ``const``s in one schema, or ``choice`` entries.
    * ``max_grammar_alternatives``: ``anyOf``/``oneOf`` branches in a schema, ``|`` in a regex or grammar.
    * ``max_regex_repetition``: the largest ``{n,m}`` bound in a regex (schema ``pattern``s included) or
      grammar, nested bounds multiplied (``(a{1,100}){1,100}`` counts 10,000).
    * ``grammar_cache_bytes``: the compiled-grammar cache of a process (LRU, by xgrammar's own memory
      accounting of each grammar plus its serialized form).
    * ``grammar_compile_workers``: compile worker processes (compiles beyond that wait their turn).
    """

    max_grammar_compile_s: float = 5.0
    max_grammar_bytes: int = 64 * 1024
    max_schema_depth: int = 32
    max_enum_values: int = 1024
    max_grammar_alternatives: int = 1024
    max_regex_repetition: int = 1000
    grammar_cache_bytes: int = 128 * 1024 * 1024
    grammar_compile_workers: int = 1

    def __post_init__(self) -> None:
        if not self.max_grammar_compile_s > 0:
            raise ConfigError(f"GrammarLimits.max_grammar_compile_s must be > 0, got {self.max_grammar_compile_s!r}")
        for f in self.__struct_fields__:
            v = getattr(self, f)
            if f != "max_grammar_compile_s" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"GrammarLimits.{f} must be a positive integer, got {v!r}")


class GrammarLimitError(InvalidRequestError):
    """A grammar refused before or while compiling: ``limit`` names the :class:`GrammarLimits`
    field (None for an unsatisfiable or unsupported schema)."""

    def __init__(self, message: str, *, limit: str | None = None) -> None:
        super().__init__(message)
        self.limit = limit
        self.param = "structured_outputs"


def _flag(limit: str) -> str:
    return "--" + limit.replace("_", "-")


def _over(what: str, value: int, limit: str, limits: GrammarLimits) -> GrammarLimitError:
    return GrammarLimitError(f"structured_outputs: {what} is {value:,}, over the limit {limit}="
                             f"{getattr(limits, limit):,} (server flag {_flag(limit)})", limit=limit)


def check_pattern(text: str, limits: GrammarLimits, what: str = "the regex") -> None:
    """Repetition bounds (nested ones multiplied) and alternations of a regex or an EBNF grammar,
    in one linear scan. Conservative: a ``|`` or ``{`` inside a quoted EBNF string counts too."""
    stack = [0]  # per open group: the largest repetition weight inside it so far
    last = 1  # the weight of the atom just read (a closed group: its inside's weight)
    alternatives = 0
    i, n = 0, len(text)
    in_class = False
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            last = 1
            continue
        if in_class:
            in_class = ch != "]"
            i += 1
            continue
        if ch == "[":
            in_class, last = True, 1
        elif ch == "(":
            stack.append(0)
            last = 1
        elif ch == ")" and len(stack) > 1:
            last = max(stack.pop(), 1)
            stack[-1] = max(stack[-1], last)
        elif ch == "|":
            alternatives += 1
        elif ch == "{":
            j = text.find("}", i)
            body = text[i + 1:j] if j > 0 else ""
            parts = body.split(",")
            if j > 0 and len(parts) <= 2 and all(p.strip().isdigit() or (k == 1 and not p.strip())
                                                 for k, p in enumerate(parts)):
                bound = max(int(p) for p in parts if p.strip())
                weight = last * max(bound, 1)
                if weight > limits.max_regex_repetition:
                    raise _over(f"a repetition bound in {what}", weight, "max_regex_repetition", limits)
                stack[-1] = max(stack[-1], weight)
                i = j + 1
                continue
        else:
            last = 1
        i += 1
    if alternatives >= limits.max_grammar_alternatives:
        raise _over(f"the number of alternatives in {what}", alternatives + 1, "max_grammar_alternatives", limits)


def _unsatisfiable(where: str, why: str) -> GrammarLimitError:
    return GrammarLimitError(f"structured_outputs: the JSON schema can never be satisfied at {where}: {why}")


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_schema(schema: Any, limits: GrammarLimits) -> None:
    """Depth, enum values, alternatives, patterns, remote ``$ref``s and the unsatisfiable shapes
    that can be seen without compiling (a required property that cannot exist, min > max, an
    empty enum, a ``false`` schema). One iterative walk: a deep schema cannot exhaust the stack."""
    if schema is False:
        raise _unsatisfiable("$", "the schema is false")
    enums = alternatives = 0
    todo: list[tuple[Any, int, str]] = [(schema, 1, "$")]
    while todo:
        node, depth, where = todo.pop()
        if isinstance(node, list):
            if depth > limits.max_schema_depth:
                raise _over("the JSON schema's nesting depth", depth, "max_schema_depth", limits)
            todo.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        if depth > limits.max_schema_depth:
            raise _over("the JSON schema's nesting depth", depth, "max_schema_depth", limits)
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise GrammarLimitError(f"structured_outputs: $ref {ref[:200]!r} at {where} is not local: only "
                                    "references inside the schema (#/...) are resolved, nothing is fetched")
        enum = node.get("enum")
        if isinstance(enum, list):
            if not enum:
                raise _unsatisfiable(where, "enum is empty")
            enums += len(enum)
        if "const" in node:
            enums += 1
        if enums > limits.max_enum_values:
            raise _over("the number of enum values in the JSON schema", enums, "max_enum_values", limits)
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                alternatives += len(node[key])
        if alternatives > limits.max_grammar_alternatives:
            raise _over("the number of anyOf/oneOf branches in the JSON schema", alternatives,
                        "max_grammar_alternatives", limits)
        if isinstance(node.get("pattern"), str):
            check_pattern(node["pattern"], limits, f"the pattern at {where}")
        for lo, hi in (("minLength", "maxLength"), ("minItems", "maxItems"), ("minimum", "maximum"),
                       ("minProperties", "maxProperties")):
            if _num(node.get(lo)) and _num(node.get(hi)) and node[lo] > node[hi]:
                raise _unsatisfiable(where, f"{lo} {node[lo]} > {hi} {node[hi]}")
        props = node.get("properties")
        props = props if isinstance(props, dict) else {}
        required = node.get("required")
        if isinstance(required, list):
            for name in required:
                if not isinstance(name, str):
                    continue
                if name in props:
                    if props[name] is False:
                        raise _unsatisfiable(where, f"required property {name!r} has the schema false")
                elif node.get("additionalProperties") is False:
                    raise _unsatisfiable(where, f"required property {name!r} is not among the properties "
                                                "and additionalProperties is false")
        for k, v in node.items():
            if isinstance(v, (dict, list)) and k not in ("enum", "const", "default", "examples", "required"):
                todo.append((v, depth + 1, f"{where}.{k}"))


def check_upfront(kind: str, text: str, limits: GrammarLimits) -> None:
    """Every check that needs no compiling, for a grammar of ``kind`` (a StructuredOutputsParams
    key's kind: json, json_object, regex, choice, grammar, with an optional _ws suffix) and text."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_grammar_bytes:
        raise _over(f"the {kind.split('_')[0]}'s size in bytes", size, "max_grammar_bytes", limits)
    if kind.startswith("json_object"):
        return
    if kind.startswith("json"):
        try:
            schema = _json.loads(text)
        except ValueError as e:
            raise GrammarLimitError(f"structured_outputs: the json does not compile: the schema is not valid JSON: {e}") from None
        check_schema(schema, limits)
    elif kind == "regex":
        check_pattern(text, limits)
    elif kind == "grammar":
        check_pattern(text, limits, "the grammar")
    elif kind == "choice":
        count = len(_json.loads(text))
        if count > limits.max_enum_values:
            raise _over("the number of choices", count, "max_enum_values", limits)
