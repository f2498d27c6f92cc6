"""LangChain ``BaseDocumentCompressor`` that reranks retrieved documents with a cross-encoder on an
in-process AsyncLLMEngine (no HTTP hop): ``pip install asyncengine[langchain]``.

    from asyncengine.integrations.langchain_rerank import AsyncEngineReranker
    rerank = AsyncEngineReranker(model="path/to/cross-encoder", top_n=3)
    best = rerank.compress_documents(docs, "what is a cat?")   # or in a ContextualCompressionRetriever

Each (query, document) pair is one ``engine.rerank`` request (engine/pooling.py) through the
engine's scheduler; the documents come back best first, at most ``top_n``, each with its
``relevance_score`` in ``metadata`` (as LangChain's Cohere and Jina rerankers put it). Engines built
from a model name are shared per model and ``engine_options`` (``engine_thread.shared_engine``).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from langchain_core.documents import BaseDocumentCompressor, Document
from pydantic import Field, PrivateAttr, model_validator

from .engine_thread import EngineBridge, arerank_texts, bridge_of, model_from_engine, rerank_texts


def ranked(documents: Sequence[Document], scores: list[float], top_n: int | None) -> list[Document]:
    """The documents best first, cut to ``top_n``, each a copy with its ``relevance_score``."""
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
    return [Document(page_content=documents[i].page_content, id=documents[i].id,
                     metadata={**documents[i].metadata, "relevance_score": scores[i]}) for i in order]


class AsyncEngineReranker(BaseDocumentCompressor):
    """A LangChain document compressor served by an in-process :class:`AsyncLLMEngine` cross-encoder."""

    model: str = Field(default_factory=lambda: os.environ.get("ASYNCENGINE_MODEL", ""), alias="model_name")
    """A cross-encoder: HF folder (env ``ASYNCENGINE_MODEL``)."""
    engine: Any = Field(default=None, exclude=True)
    """An AsyncLLMEngine to use instead of building one from ``model``."""
    engine_options: dict[str, Any] = Field(default_factory=dict)
    """EngineConfig fields for the engine built from ``model`` (e.g. ``{"dtype": "float32"}``)."""
    top_n: int | None = 3
    """Documents kept, best first (None: all of them, reordered)."""

    _bridge: EngineBridge | None = PrivateAttr(default=None)

    model_config = {"populate_by_name": True, "arbitrary_types_allowed": True}

    @model_validator(mode="before")
    @classmethod
    def _model_from_engine(cls, values: Any) -> Any:
        return model_from_engine(values, "model")  # a given engine names the model

    @property
    def bridge(self) -> EngineBridge:
        return bridge_of(self, self.model)

    def compress_documents(self, documents: Sequence[Document], query: str, callbacks=None) -> Sequence[Document]:
        return ranked(documents, rerank_texts(self.bridge, query, [d.page_content for d in documents]), self.top_n)

    async def acompress_documents(self, documents: Sequence[Document], query: str,
                                  callbacks=None) -> Sequence[Document]:
        scores = await arerank_texts(self.bridge, query, [d.page_content for d in documents])
        return ranked(documents, scores, self.top_n)


__all__ = ["AsyncEngineReranker"]
