"""A small hand-written OpenAPI 3.1 document of the server's HTTP endpoints (served at
/openapi.json; the fuzz tests generate requests from it). It describes what the server accepts:
a request valid under it never gets a 5xx."""
from __future__ import annotations

import copy

from .protocol import MAX_LOGPROBS, MAX_N


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


_ERRORS = {str(code): {"description": desc, "content": {"application/json": {"schema": _ref("Error")}}}
           for code, desc in ((400, "Invalid request, or over a request limit (the message names it)"),
                              (401, "Missing or wrong API key"),
                              (403, "Host or Origin not allowed (DNS rebinding / cross-site protection)"),
                              (404, "Unknown model"), (413, "The body is over max_request_bytes"),
                              (415, "Content-Type is not application/json"),
                              (429, "The engine's waiting queue is full"),
                              (500, "The engine died, or this request failed inside it"),
                              (503, "The server is shutting down"))}
_GET_ERRORS = {k: _ERRORS[k] for k in ("401", "403")}

_SAMPLING = {
    "model": {"type": "string", "description": "the served model name"},
    "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "stop": {"anyOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4},
                       {"type": "null"}]},
    "seed": _nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}),
    "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "user": {"type": "string"},
    "top_k": _nullable({"type": "integer", "minimum": -1}),
    "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 10}),
    "ignore_eos": {"type": "boolean"},
}

_STREAM = {
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": {"type": "boolean"}}}),
}

# stream_options only with stream: true (as OpenAI)
_STREAM_ONLY = {"stream_options": {"required": ["stream"], "properties": {"stream": {"const": True}}}}

# one server-sent event (OpenAPI < 3.2: the schema of an event stream describes each event): a JSON
# chunk, or the final [DONE]
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string", "pattern": "^(\\[DONE\\]|\\{.*\\})$"},
                             "event": {"type": "string"}}}

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer", "minimum": 0}
                         for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}

_TEXTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]}


def _token_ids() -> dict:
    return {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

_DOC = {
    "openapi": "3.1.0",
    "info": {"title": "asyncengine OpenAI-compatible API", "version": "0.1.0",
             "description": "OpenAI's completions and chat completions (JSON or server-sent events), models, "
                            "/v1/embeddings, /v1/score and /v1/rerank, vLLM's /tokenize and /detokenize, health and Prometheus metrics. Websocket chat: /v1/ws/chat (not described here)."},
    "paths": {
        "/v1/completions": {"post": {
            "operationId": "createCompletion",
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("CompletionRequest")}}},
            "responses": {"200": {"description": "The completion (JSON), or its chunks as server-sent events",
                                  "content": {"application/json": {"schema": _ref("Completion")},
                                              "text/event-stream": {"schema": _SSE_EVENT}}},
                          **_ERRORS}}},
        "/v1/chat/completions": {"post": {
            "operationId": "createChatCompletion",
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ref("ChatCompletionRequest")}}},
            "responses": {"200": {"description": "The chat completion (JSON), or its chunks as server-sent events",
                                  "content": {"application/json": {"schema": _ref("ChatCompletion")},
                                              "text/event-stream": {"schema": _SSE_EVENT}}},
                          **_ERRORS}}},
        "/tokenize": {"post": {
            "operationId": "tokenize",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "properties": {
                    "model": {"type": "string"}, "prompt": {"type": "string"},
                    "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
                    "add_special_tokens": _nullable({"type": "boolean"}), "return_token_strs": {"type": "boolean"},
                    "chat_template_kwargs": _nullable({"type": "object"})}}}}},
            "responses": {"200": {"description": "The token ids (vLLM's shape)", "content": {"application/json": {
                "schema": {"type": "object", "required": ["count", "max_model_len", "tokens"],
                           "properties": {"count": {"type": "integer"}, "tokens": {"type": "array"}}}}}},
                          **_ERRORS}}},
        "/detokenize": {"post": {
            "operationId": "detokenize",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["tokens"],
                "properties": {"model": {"type": "string"}, "tokens": _token_ids()}}}}},
            "responses": {"200": {"description": "The text", "content": {"application/json": {"schema": {
                "type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}}}},
                          **_ERRORS}}},
        "/v1/embeddings": {"post": {
            "operationId": "createEmbedding",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["input"], "properties": {
                    "model": {"type": "string"},
                    "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
                                        _token_ids(), {"type": "array", "items": _token_ids(), "minItems": 1}]},
                    "encoding_format": {"enum": ["float", "base64"]},
                    "dimensions": _nullable({"type": "integer", "minimum": 1})}}}}},
            "responses": {"200": {"description": "One embedding per input (floats, or base64 float32)",
                                  "content": {"application/json": {"schema": {
                                      "type": "object", "required": ["object", "data", "model", "usage"],
                                      "properties": {"data": {"type": "array", "items": {
                                          "type": "object", "required": ["object", "index", "embedding"]}}}}}}},
                          **_ERRORS}}},
        "/v1/score": {"post": {
            "operationId": "createScore",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["text_1", "text_2"], "properties": {
                    "model": {"type": "string"}, "text_1": _TEXTS, "text_2": _TEXTS}}}}},
            "responses": {"200": {"description": "A cross-encoder's score per pair (vLLM's shape; 400 on a model "
                                                 "that cannot rerank)", "content": {"application/json": {"schema": {
                "type": "object", "required": ["data", "model", "usage"], "properties": {"data": {
                    "type": "array", "items": {"type": "object", "required": ["index", "score"]}}}}}}},
                          **_ERRORS}}},
        "/v1/rerank": {"post": {
            "operationId": "createRerank",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["query", "documents"], "properties": {
                    "model": {"type": "string"}, "query": {"type": "string"},
                    "documents": {"type": "array", "minItems": 1, "items": {"anyOf": [
                        {"type": "string"}, {"type": "object", "required": ["text"],
                                             "properties": {"text": {"type": "string"}}}]}},
                    "top_n": _nullable({"type": "integer", "minimum": 1}), "return_documents": {"type": "boolean"}}}}}},
            "responses": {"200": {"description": "The documents best first (Jina / Cohere shape; 400 on a model "
                                                 "that cannot rerank)", "content": {"application/json": {"schema": {
                "type": "object", "required": ["results", "model", "usage"], "properties": {"results": {
                    "type": "array", "items": {"type": "object", "required": ["index", "relevance_score"]}}}}}}},
                          **_ERRORS}}},
        "/v1/models": {"get": {
            "operationId": "listModels",
            "responses": {"200": {"description": "The served model",
                                  "content": {"application/json": {"schema": _ref("ModelList")}}},
                          **_GET_ERRORS}}},
        "/v1/models/{model}": {"get": {
            "operationId": "retrieveModel",
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "The served model",
                                  "content": {"application/json": {"schema": {"type": "object",
                                                                              "required": ["id", "object"]}}}},
                          "404": _ERRORS["404"], **_GET_ERRORS}}},
        "/health": {"get": {
            "operationId": "health",
            "responses": {"200": {"description": "Ready", "content": {"application/json": {"schema": {"type": "object"}}}},
                          "403": _ERRORS["403"],
                          "503": {"description": "Shutting down, or the engine died (a model fault)",
                                  "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        "/metrics": {"get": {
            "operationId": "metrics",
            "responses": {"200": {"description": "Prometheus text format",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}},
                          **_GET_ERRORS}}},
        "/openapi.json": {"get": {
            "operationId": "openapi",
            "responses": {"200": {"description": "This document",
                                  "content": {"application/json": {"schema": {"type": "object"}}}},
                          **_GET_ERRORS}}},
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                "type": "object", "required": ["message", "type", "param", "code"],
                "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                               "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
            "CompletionRequest": {
                "type": "object", "required": ["model", "prompt"], "dependentSchemas": _STREAM_ONLY,
                "properties": {
                    "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                                         {"type": "array", "items": {"type": "string", "minLength": 1},
                                          "minItems": 1},
                                         _token_ids(),
                                         {"type": "array", "items": _token_ids(), "minItems": 1}]},
                    "max_tokens": _nullable({"type": "integer", "minimum": 1}),
                    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
                    "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
                    "echo": {"type": "boolean"},
                    **_SAMPLING, **_STREAM}},
            "ChatMessage": {
                "type": "object", "required": ["role", "content"],
                "properties": {
                    "role": {"enum": ["system", "developer", "user", "assistant"]},
                    "content": {"anyOf": [
                        {"type": "string"},
                        {"type": "array", "minItems": 1, "items": {
                            "type": "object", "required": ["type", "text"],
                            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
                    "name": {"type": "string"}}},
            "ChatCompletionRequest": {
                "type": "object", "required": ["model", "messages"],
                "dependentSchemas": {**_STREAM_ONLY, "top_logprobs": {"required": ["logprobs"],
                                                                       "properties": {"logprobs": {"const": True}}}},
                "properties": {
                    "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
                    "max_tokens": _nullable({"type": "integer", "minimum": 1}),
                    "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
                    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
                    "logprobs": _nullable({"type": "boolean"}),
                    "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
                    **_SAMPLING, **_STREAM}},
            "Completion": {
                "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                "properties": {
                    "id": {"type": "string"}, "object": {"const": "text_completion"},
                    "created": {"type": "integer"}, "model": {"type": "string"},
                    "choices": {"type": "array", "items": {
                        "type": "object", "required": ["index", "text", "finish_reason"],
                        "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                       "logprobs": {"type": ["object", "null"]},
                                       "finish_reason": {"type": ["string", "null"]}}}},
                    "usage": _USAGE}},
            "ChatCompletion": {
                "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                "properties": {
                    "id": {"type": "string"}, "object": {"const": "chat.completion"},
                    "created": {"type": "integer"}, "model": {"type": "string"},
                    "choices": {"type": "array", "items": {
                        "type": "object", "required": ["index", "message", "finish_reason"],
                        "properties": {
                            "index": {"type": "integer"},
                            "message": {"type": "object", "required": ["role", "content"],
                                        "properties": {"role": {"const": "assistant"},
                                                       "content": {"type": ["string", "null"]}}},
                            "logprobs": {"type": ["object", "null"]},
                            "finish_reason": {"type": ["string", "null"]}}}},
                    "usage": _USAGE}},
            "ModelList": {
                "type": "object", "required": ["object", "data"],
                "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
                    "type": "object", "required": ["id", "object", "owned_by"],
                    "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                   "owned_by": {"type": "string"}}}}}},
        },
    },
}


def document(model_name: str | None = None, vocab_size: int | None = None, adapters=()) -> dict:
    """The OpenAPI document; with ``model_name``, ``model`` is documented as that name or one of the
    LoRA ``adapters``' names, with ``vocab_size`` the range of token ids."""
    doc = copy.deepcopy(_DOC)
    schemas = doc["components"]["schemas"]
    if model_name is not None:
        for req in ("CompletionRequest", "ChatCompletionRequest"):
            schemas[req]["properties"]["model"] = {"enum": [model_name, *adapters]}
    if vocab_size is not None:
        prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
        prompt[2]["items"]["maximum"] = vocab_size - 1
        prompt[3]["items"]["items"]["maximum"] = vocab_size - 1
    return doc
