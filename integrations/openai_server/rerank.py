"""Cross-encoder scores over HTTP, in the two shapes vLLM serves (``engine.rerank``: each (query,
document) pair one request through the scheduler; a one-label cross-encoder's sigmoid):

* ``POST /v1/score`` {"text_1", "text_2"}: one text against a list, or two lists pairwise
  (vLLM's score API) -> ``data[i].score`` in input order;
* ``POST /v1/rerank`` (and ``/v2/rerank``) {"query", "documents", "top_n", "return_documents"}:
  the Jina / Cohere rerank shape -> ``results`` sorted by ``relevance_score``, best first.

Bounded as completion prompts are: at most ``max_prompts`` pairs, their characters, and each pair
within the model's length. A model that cannot rerank (a generative one), no documents, a pair
over the length: 400 naming the field."""
from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncengine.errors import AsyncEngineError

from .errors import APIError, from_engine
from .state import json_response as _json, server_state as _state

ROUTES = ("/v1/score", "/v1/rerank", "/v2/rerank")


class ScoreRequest(msgspec.Struct, kw_only=True):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: str | None = None


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: list[Any]  # texts, or {"text": ...} objects (Cohere)
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    user: str | None = None


def _pairs_of_score(req: ScoreRequest) -> tuple[list[str], list[str]]:
    t1 = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
    t2 = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
    if not t1 or not t2:
        raise APIError(400, "text_1 and text_2 must not be empty", param="text_1" if not t1 else "text_2")
    if len(t1) == 1:
        t1 = t1 * len(t2)
    if len(t1) != len(t2):
        raise APIError(400, f"text_1 has {len(t1)} texts and text_2 {len(t2)}: give one text_1, or as many as "
                            "text_2", param="text_1")
    return t1, t2


def _document_texts(docs: list[Any]) -> list[str]:
    if not docs:
        raise APIError(400, "documents must not be empty", param="documents")
    out = []
    for d in docs:
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str):
            raise APIError(400, "each document must be a text or an object with a text field", param="documents")
        out.append(text)
    return out


async def _scores(request: Request, model: str | None, queries: list[str], docs: list[str],
                  param: str) -> tuple[object, list[float], int]:
    """(server state, score per pair, prompt tokens): the checks, then ``engine.rerank``."""
    st = _state(request)
    if st.resolve_model(model) is not None:
        raise APIError(400, f"scores come from the base model `{st.model_name}`, not a LoRA adapter", param="model")
    if "classify" not in st.engine.supported_tasks:
        raise APIError(400, f"the model `{st.model_name}` cannot rerank or score: it serves "
                            f"{', '.join(st.engine.supported_tasks)} (serve a cross-encoder)", param="model")
    limits = st.limits
    if len(docs) > limits.max_prompts:
        raise APIError(400, f"{len(docs)} pairs: over the limit max_prompts={limits.max_prompts}",
                       param=param, code="limit_exceeded")
    if sum(map(len, queries)) + sum(map(len, docs)) > limits.prompt_chars(st.max_model_len):
        raise APIError(400, f"the texts' length (characters) is over the limit max_prompt_chars="
                            f"{limits.prompt_chars(st.max_model_len)}", param=param, code="limit_exceeded")
    try:
        scores = await st.engine.rerank(queries, docs)
    except AsyncEngineError as e:
        err = from_engine(e, st.engine)
        if err.status == 400:
            err.param = err.param or param
        raise err from None
    tok = st.engine.tokenizer
    n = sum(len(tok(q, d)["input_ids"]) for q, d in zip(queries, docs))
    return st, scores, n


async def score(request: Request) -> Response:
    st = _state(request)
    req: ScoreRequest = await st.read_json(request, ScoreRequest)
    t1, t2 = _pairs_of_score(req)
    st, scores, n = await _scores(request, req.model, t1, t2, "text_2")
    return _json({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                  "model": st.model_name,
                  "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                  "usage": {"prompt_tokens": n, "total_tokens": n}})


async def rerank(request: Request) -> Response:
    st = _state(request)
    req: RerankRequest = await st.read_json(request, RerankRequest)
    docs = _document_texts(req.documents)
    if req.top_n is not None and req.top_n < 1:
        raise APIError(400, "top_n must be a positive integer", param="top_n")
    st, scores, n = await _scores(request, req.model, [req.query] * len(docs), docs, "documents")
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n or len(docs)]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": docs[i]}} if req.return_documents else {})} for i in order]
    return _json({"id": f"rerank-{uuid.uuid4().hex}", "model": st.model_name, "results": results,
                  "usage": {"prompt_tokens": n, "total_tokens": n}})
