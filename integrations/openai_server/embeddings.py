"""OpenAI's /v1/embeddings: a text, a list of texts, token ids or lists of token ids -> one
embedding each (``engine.embed``: pooled final hidden states, L2-normalised; engine/pooling.py),
as float lists or base64 of little-endian float32 (what the official client asks for by
default). ``dimensions`` truncates before normalising (Matryoshka). Bounded as completion
prompts are: max_prompts inputs, their characters, max_model_len tokens each."""
from __future__ import annotations

import base64
import struct
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncengine.errors import AsyncEngineError

from .errors import APIError, from_engine
from .state import json_response as _json, server_state as _state


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list[Any]
    model: str | None = None
    encoding_format: str = "float"  # "float" | "base64"
    dimensions: int | None = None
    user: str | None = None


def encode_vector(v: list[float], fmt: str):
    """The vector as the response carries it: floats, or base64 of little-endian float32."""
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")
    return v


async def embeddings(request: Request) -> Response:
    st = _state(request)
    req: EmbeddingRequest = await st.read_json(request, EmbeddingRequest)
    if st.resolve_model(req.model) is not None:  # an unknown name is 404 there
        raise APIError(400, f"embeddings are computed by the base model `{st.model_name}`, not under a LoRA "
                            f"adapter: name the base model", param="model")
    if req.encoding_format not in ("float", "base64"):
        raise APIError(400, "encoding_format must be 'float' or 'base64'", param="encoding_format")
    if req.dimensions is not None and req.dimensions < 1:
        raise APIError(400, "dimensions must be a positive integer", param="dimensions")
    try:
        prompts = await st.completion_prompts(req.input)
    except APIError as e:  # the same rules as a completion's prompt, named as this API names it
        e.param = "input" if e.param == "prompt" else e.param
        raise
    for _, ids in prompts:
        st.check_length(len(ids), 1, "input")
    try:
        vectors = await st.engine.embed([ids for _, ids in prompts], dimensions=req.dimensions)
    except AsyncEngineError as e:
        err = from_engine(e, st.engine)
        if err.status == 400:
            err.param = err.param or ("dimensions" if "dimensions" in str(e) else "input")
        raise err from None
    n = sum(len(ids) for _, ids in prompts)
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return _json({"object": "list", "data": data, "model": st.model_name,
                  "usage": {"prompt_tokens": n, "total_tokens": n}})
