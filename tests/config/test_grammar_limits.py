"""The upfront grammar checks (structured/limits.py): each hostile pattern of issue 27 is refused
before compiling, naming its limit and flag; what real schemas look like passes; the checks are
linear (a deep or huge input cannot exhaust the stack)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from asyncengine.errors import ConfigError, InvalidRequestError
from asyncengine.config.grammar_limits import GrammarLimitError, GrammarLimits, check_pattern, check_upfront

L = GrammarLimits()


def refused(kind: str, spec, limit: str | None = None) -> GrammarLimitError:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    with pytest.raises(GrammarLimitError) as e:
        check_upfront(kind, text, L)
    if limit != "any":
        assert e.value.limit == limit
    if limit not in (None, "any"):
        assert "--" + limit.replace("_", "-") in str(e.value)
    return e.value


def test_repetition_bounds_are_refused_nested_ones_multiplied():
    refused("json", {"type": "string", "pattern": "[a-z]{1,5000}"}, "max_regex_repetition")
    refused("regex", "[a-z]{20000}", "max_regex_repetition")
    refused("regex", "x{5000,}", "max_regex_repetition")
    refused("regex", "(a{1,100}){1,100}", "max_regex_repetition")  # 10,000 once expanded
    refused("regex", "((ab){1,40}c){1,40}", "max_regex_repetition")
    refused("grammar", 'root ::= [a-z]{1,9999}', "max_regex_repetition")
    check_upfront("regex", "[a-z]{1,1000}", L)
    check_upfront("regex", r"\d{3}-\d{4}", L)
    check_upfront("regex", r"a\{99999\}", L)  # escaped braces are literals
    check_upfront("regex", "[{]99999}", L)  # inside a class too


def test_enums_alternatives_depth_and_size():
    refused("json", {"enum": [f"v{i}" for i in range(10_000)]}, "any")  # over the size limit as well
    refused("json", {"enum": [f"v{i}" for i in range(2_000)]}, "max_enum_values")
    refused("json", {"type": "object", "properties": {f"p{i}": {"const": i} for i in range(1100)}},
            "max_enum_values")
    refused("choice", [f"c{i}" for i in range(2000)], "max_enum_values")
    refused("regex", "|".join(f"w{i}" for i in range(10_000)), "any")
    refused("regex", "|".join(f"w{i}" for i in range(2_000)), "max_grammar_alternatives")
    refused("json", {"anyOf": [{"const": i} for i in range(900)] + [{"type": "string"}] * 200},
            "max_grammar_alternatives")
    deep = {"type": "string"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    refused("json", deep, "max_schema_depth")
    refused("json", {"type": "object", "description": "x" * 70_000}, "max_grammar_bytes")
    check_upfront("json", json.dumps({"enum": [f"v{i}" for i in range(1000)]}), L)


def test_remote_refs_and_unsatisfiable_schemas_are_refused():
    e = refused("json", {"$ref": "https://example.com/schema.json"})
    assert "not local" in str(e)
    refused("json", {"properties": {"a": {"$ref": "other.json#/x"}}})
    for schema in ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"],
                    "additionalProperties": False},
                   {"type": "string", "minLength": 5, "maxLength": 2},
                   {"type": "array", "minItems": 3, "maxItems": 1},
                   {"type": "integer", "minimum": 10, "maximum": 1},
                   {"enum": []},
                   {"type": "object", "properties": {"a": False}, "required": ["a"]}):
        assert "never be satisfied" in str(refused("json", schema))
    assert "never be satisfied" in str(refused("json", "false"))
    circular = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
                "$ref": "#/$defs/node"}
    check_upfront("json", json.dumps(circular), L)  # local and recursive: compiled, not refused here
    assert isinstance(refused("json", "{not json"), InvalidRequestError)


def test_limits_are_validated():
    with pytest.raises(ConfigError):
        GrammarLimits(max_grammar_compile_s=0)
    with pytest.raises(ConfigError):
        GrammarLimits(max_enum_values=0)
    assert GrammarLimits(max_regex_repetition=20_000).max_regex_repetition == 20_000


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab|(){}[],0123456789\\*+?", max_size=200))
def test_check_pattern_never_crashes(text):
    """Any text: the scan answers (refused or not) without an exception other than its own."""
    try:
        check_pattern(text, L)
    except GrammarLimitError:
        pass


def test_deep_schema_walk_does_not_recurse():
    deep: dict = {}
    node = deep
    for _ in range(50_000):
        node["items"] = {}
        node = node["items"]
    with pytest.raises(GrammarLimitError):
        from asyncengine.config.grammar_limits import check_schema
        check_schema(deep, L)
