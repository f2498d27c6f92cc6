"""Schemathesis against the server's own OpenAPI document (/openapi.json): requests generated from
it, valid ones and deliberately invalid ones, never get a 5xx; valid ones get responses that match
the documented schemas. Few examples per operation, derandomized (the same ones every run), on a
server with a 64-token context so every generation is short."""
from __future__ import annotations

import copy

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance, \
    status_code_conformance

EXAMPLES = {"POST /v1/completions": 30, "POST /v1/chat/completions": 30, "GET /v1/models": 5,
            "GET /health": 5, "GET /metrics": 5, "POST /v1/embeddings": 15}
NEGATIVE_EXAMPLES = 15
HYPOTHESIS = dict(deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))


def small(doc: dict) -> dict:
    """The served document with tighter bounds on what costs engine time (n, token counts), so
    the valid examples stay cheap; the server itself allows more."""
    doc = copy.deepcopy(doc)
    schemas = doc["components"]["schemas"]
    for req in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[req]["properties"]
        props["n"]["maximum"] = 2
        for k in ("max_tokens", "max_completion_tokens"):
            if k in props:
                props[k] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 8}, {"type": "null"}]}
        props["max_tokens"]["anyOf"][0]["maximum"] = 8
    schemas["ChatCompletionRequest"]["required"].append("max_tokens")
    schemas["CompletionRequest"]["required"].append("max_tokens")
    schemas["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] = 3
    return doc


@pytest.fixture(scope="module")
def api(fuzz_server):
    import httpx

    doc = httpx.get(fuzz_server.base_url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1") and set(doc["paths"]) >= {"/v1/completions", "/v1/chat/completions"}
    return schemathesis.openapi.from_dict(small(doc)), schemathesis.openapi.from_dict(doc)


def _operation(schema, key: str):
    method, path = key.split(" ", 1)
    return schema[path][method]


@pytest.mark.parametrize("key", list(EXAMPLES))
def test_valid_requests_never_5xx_and_match_schema(api, fuzz_server, key):
    op = _operation(api[0], key)

    @settings(max_examples=EXAMPLES[key], **HYPOTHESIS)
    @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def run(case):
        case.call_and_validate(base_url=fuzz_server.base_url, timeout=60,
                               checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                       response_schema_conformance])

    run()
    fuzz_server.wait_clean()


@pytest.mark.parametrize("key", ["POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings"])
def test_invalid_requests_never_5xx(api, fuzz_server, key):
    op = _operation(api[1], key)

    @settings(max_examples=NEGATIVE_EXAMPLES, **HYPOTHESIS)
    @given(case=op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    def run(case):
        case.call_and_validate(base_url=fuzz_server.base_url, timeout=60, checks=[not_a_server_error])

    run()
    fuzz_server.wait_clean()
