"""Hostile structured outputs against a live server, in-process, with the engine core in its own
process, and with two data-parallel cores: every pattern of issue 27 (huge repetition bounds, 10k
enums, 10k alternations, deep nesting, remote and circular refs, unsatisfiable schemas) is
answered within the compile budget, as a 400 naming its limit or a valid constrained answer; a
normal stream sent alongside completes; the server serves on afterwards.

How long the normal request takes alongside is a benchmark figure (benchmarks/hostile_grammar.py),
not asserted here."""
from __future__ import annotations

import json
import threading
import time

import jsonschema
import openai
import pytest

import xgrammar  # noqa: E402,F401  (a main dependency: missing fails the run, never skips it)

from live_server import HANG_GUARD_S, MODEL, LiveServer, make_engine  # noqa: E402

import xgrammar as xgr  # noqa: E402
from xgrammar.testing import _get_matcher_from_grammar  # noqa: E402

from asyncengine.config.grammar_limits import GrammarLimits  # noqa: E402

# the repetition limit is raised so that the 50,000-bound pattern reaches the compiler and is
# stopped by the budget (xgrammar needs minutes for it); everything else meets the default limits
LIMITS = GrammarLimits(max_grammar_compile_s=2.0, max_regex_repetition=10**6)


def _deep(levels: int) -> dict:
    s: dict = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(levels):
        s = {"type": "object", "properties": {"x": s}, "required": ["x"], "additionalProperties": False}
    return s


HOSTILE = {  # name -> (schema, the limit that refuses it, or None: a valid answer is due)
    "repetition-50000": ({"type": "string", "pattern": "[a-z]{1,50000}"}, "max_grammar_compile_s"),
    "repetition-1000": ({"type": "string", "pattern": "[a-z]{1,1000}"}, None),  # ~0.1 s: within budget
    "nested-repetition": ({"type": "string", "pattern": "([a-z]{1,2000}){1,1000}"}, "max_regex_repetition"),
    "enum-10k": ({"enum": [f"v{i}" for i in range(10_000)]}, "max_grammar_bytes"),
    "enum-2k": ({"enum": [f"v{i}" for i in range(2_000)]}, "max_enum_values"),
    "alternations-10k": ({"type": "string", "pattern": "|".join(f"w{i}" for i in range(10_000))},
                         "max_grammar_alternatives"),
    "anyof-2k": ({"anyOf": [{"const": i} for i in range(1000)] + [{"type": "string"}] * 1000},
                 "max_grammar_alternatives"),
    "deep-20": (_deep(20), "max_schema_depth"),
    "deep-8": (_deep(8), None),
    "remote-ref": ({"$ref": "https://example.com/schema.json"}, "remote"),
    "circular-ref": ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                      "additionalProperties": False}}, "$ref": "#/$defs/n"}, None),
    "unsatisfiable-required": ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"],
                                "additionalProperties": False}, "unsatisfiable"),
    "unsatisfiable-bounds": ({"type": "string", "minLength": 9, "maxLength": 2}, "unsatisfiable"),
}
NORMAL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module", params=["in-process", "core-process", "dp2"])
def hostile_server(request, tiny_llama_dir):
    kw = {"in-process": {}, "core-process": {"engine_core_process": True},
          "dp2": {"data_parallel_size": 2}}[request.param]
    s = LiveServer(make_engine(tiny_llama_dir, grammar_limits=LIMITS, num_threads=1, **kw),
                   own_engine=True).start()
    yield s
    s.stop()


def _chat(c, schema, **kw):
    kw.setdefault("max_tokens", 60)
    return c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "answer"}], temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, **kw)


def assert_allowed(choice, schema: dict, name: str) -> None:
    """Every answer, cut or not, is text the schema's grammar accepts (compact JSON, as the server
    compiles it); one that stopped is a whole document that validates."""
    text = choice.message.content
    assert choice.finish_reason in ("stop", "length"), name
    matcher = _get_matcher_from_grammar(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    assert matcher.accept_string(text), f"{name}: {text!r} is no prefix of a document the schema allows"
    if choice.finish_reason == "stop":
        assert matcher.is_terminated(), f"{name}: {text!r} stopped before the document ended"
        jsonschema.validate(json.loads(text), schema)


def test_hostile_schemas_are_refused_or_answered_and_normal_requests_go_on(hostile_server):
    with openai.OpenAI(base_url=hostile_server.base_url + "/v1", api_key="x", max_retries=0,
                       timeout=HANG_GUARD_S) as c:
        assert_allowed(_chat(c, NORMAL).choices[0], NORMAL, "warm")  # the compile worker is up
        normal: list = []
        # a normal stream runs while the hostile ones compile (and are killed)
        t = threading.Thread(target=lambda: normal.append(list(c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=200, stream=True,
            extra_body={"ignore_eos": True}))))
        t.start()
        for name, (schema, refused_by) in HOSTILE.items():
            if refused_by is None:
                assert_allowed(_chat(c, schema).choices[0], schema, name)
                continue
            with pytest.raises(openai.BadRequestError) as e:
                _chat(c, schema)
                pytest.fail(f"{name} was not refused")
            msg = str(e.value)
            if refused_by == "remote":
                assert "not local" in msg, name
            elif refused_by == "unsatisfiable":
                assert "never be satisfied" in msg, name
            else:
                assert refused_by in msg and "--" + refused_by.replace("_", "-") in msg, (name, msg)
                assert e.value.body["code"] == "limit_exceeded"
        t.join(HANG_GUARD_S)
        assert not t.is_alive()
        chunks = normal[0]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) > 0
        # still serving, constrained, after all that
        assert_allowed(_chat(c, NORMAL, max_tokens=20).choices[0], NORMAL, "normal")
    _wait_idle(hostile_server)


def _wait_idle(s: LiveServer) -> None:
    """Bounded: no stream left in the front end, nothing running or waiting in any core (KV
    blocks are checked in-process, where the test can see them)."""
    e = s.engine
    if not e.config.engine_core_process and e.config.data_parallel_size == 1:
        return s.wait_clean()
    for _ in range(int(HANG_GUARD_S / 0.05)):
        if s.on_loop(lambda: not e._slots and e.client.num_running == 0 and e.client.num_waiting == 0):
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {s.stats()}")
