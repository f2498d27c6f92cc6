"""Embedding requests as the front end builds them: each input runs as an ordinary request whose
SamplingParams carry a PoolingSpec and ``max_tokens=1``, so it shares the scheduler and the
batches with generation, takes no decode step (it finishes with the token sampled at the end of
its prompt, which is dropped) and frees its KV like any finished request. Its embedding arrives
in ``RequestOutput.embedding`` (worker/pooling.py computes it).

Rerank requests are the same with ``PoolingSpec(task="classify")``: each (query, document) pair
is one prompt (the tokenizer's pair encoding: ``[CLS] query [SEP] document [SEP]`` for BERT, its
token types as ``token_type_split``), the model's classification head turns the pooled row into
logits, and a one-label cross-encoder's score is their sigmoid (sentence-transformers'
``CrossEncoder.predict``, the Jina/Cohere rerank APIs)."""
from __future__ import annotations

import math

from asyncengine.engine.scoring import token_ids
from asyncengine.errors import InvalidRequestError
from asyncengine.pooling_params import PoolingSpec
from asyncengine.sampling_params import OutputKind, SamplingParams

DEFAULT_POOLING = "last"  # decoder embedding models (Qwen3-Embedding, e5-mistral): the last token


def embed_inputs(inputs) -> list:
    """The inputs as a list: one text or one list of token ids is a batch of one."""
    if isinstance(inputs, str) or (isinstance(inputs, dict) and "prompt_token_ids" in inputs):
        return [inputs]
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(t, int) for t in inputs):
        return [list(inputs)]
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise InvalidRequestError("embed needs a text, a list of token ids, or a non-empty list of them")
    return list(inputs)


def pooling_params(spec: PoolingSpec) -> SamplingParams:
    """The params of one pooling request (the spec validated: a bad one is a 400)."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                          output_kind=OutputKind.FINAL_ONLY, pooling=spec.validated())


def embed_params(pooling: str | None = None, normalize: bool = True, dimensions: int | None = None) -> SamplingParams:
    """The params of one embedding request (validated: a bad pooling or dimensions is a 400)."""
    return pooling_params(PoolingSpec(pooling or DEFAULT_POOLING, bool(normalize), dimensions))


def embed_requests(tokenizer, inputs, pooling=None, normalize=True, dimensions=None,
                   default_pooling: str = DEFAULT_POOLING) -> list[tuple[dict, SamplingParams]]:
    """(prompt for generate, params) per input; text goes through the tokenizer with its special
    tokens. ``default_pooling``: the model's, when the caller names none (models/pooling_models.py)."""
    params = embed_params(pooling or default_pooling, normalize, dimensions)
    out = []
    for x in embed_inputs(inputs):
        ids = token_ids(tokenizer, x, "input", special=True)
        if not ids:
            raise InvalidRequestError("embed needs a non-empty input")
        out.append(({"prompt_token_ids": ids}, params))
    return out


def rerank_pairs(query, documents) -> list[tuple[str, str]]:
    """(query, document) per pair: one query against every document (rerank, /v1/score's
    ``text_1`` string), or queries and documents pairwise (lists of one length)."""
    docs = [documents] if isinstance(documents, str) else documents
    if not isinstance(docs, (list, tuple)) or not docs:
        raise InvalidRequestError("rerank needs at least one document")
    queries = [query] * len(docs) if isinstance(query, str) else query
    if not isinstance(queries, (list, tuple)) or len(queries) != len(docs):
        raise InvalidRequestError(f"rerank needs one query, or one per document ({len(docs)}); got "
                                  f"{len(queries) if isinstance(queries, (list, tuple)) else type(query).__name__}")
    for what, texts in (("query", queries), ("document", docs)):
        if not all(isinstance(t, str) for t in texts):
            raise InvalidRequestError(f"every {what} must be a text")
    return list(zip(queries, docs))


def rerank_requests(tokenizer, query, documents, max_len: int,
                    pooling: str = "cls") -> list[tuple[dict, SamplingParams]]:
    """(prompt, params) per (query, document) pair, as the tokenizer encodes a pair; a pair of
    ``max_len`` tokens or more is an InvalidRequestError naming it. ``pooling``: the row the model's head
    reads ([CLS] for BERT, the last token for a decoder classifier)."""
    if tokenizer is None:
        raise InvalidRequestError("rerank needs a tokenizer (the model was loaded without one)")
    out = []
    for i, (q, d) in enumerate(rerank_pairs(query, documents)):
        enc = tokenizer(q, d)
        ids, types = list(enc["input_ids"]), list(enc.get("token_type_ids") or [])
        if len(ids) >= max_len:  # as every prompt: shorter than max_model_len (its one token is dropped)
            raise InvalidRequestError(f"pair {i} (query and document {i}) is {len(ids)} tokens; the model "
                                      f"takes at most {max_len - 1}")
        split = types.index(1) if 1 in types else None
        if split is not None and types[split:] != [1] * (len(types) - split):
            raise InvalidRequestError("the tokenizer's token types are not one query then one document")
        spec = PoolingSpec(pooling, normalize=False, task="classify", token_type_split=split)
        out.append(({"prompt_token_ids": ids}, pooling_params(spec)))
    return out


def relevance(logits: list[float]) -> float:
    """A one-label cross-encoder's relevance in (0, 1): the sigmoid of its logit."""
    if len(logits) != 1:
        raise InvalidRequestError(f"rerank needs a one-label cross-encoder; this model has {len(logits)} labels")
    x = logits[0]
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
