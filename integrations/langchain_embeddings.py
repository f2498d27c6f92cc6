"""LangChain ``Embeddings`` over an in-process AsyncLLMEngine (no HTTP hop): ``pip install asyncengine[langchain]``.

    from asyncengine.integrations.langchain_embeddings import AsyncEngineEmbeddings
    emb = AsyncEngineEmbeddings(model="smollm2-135m-instruct")   # the engine loads on first use
    emb.embed_documents(["a cat sat on the mat", "stock prices fell"]);  await emb.aembed_query("cats")

Each text is one ``engine.embed`` request (engine/pooling.py): it runs through the same scheduler
and batches as generation, so one engine serves a chat model and its retriever. Engines built from
a model name are shared with ``ChatAsyncEngine`` for the same model and ``engine_options``.
"""
from __future__ import annotations

import os
from typing import Any

from langchain_core.embeddings import Embeddings
from pydantic import BaseModel, Field, PrivateAttr, model_validator

from .engine_thread import EngineBridge, aembed_texts, bridge_of, model_from_engine, embed_texts


class AsyncEngineEmbeddings(BaseModel, Embeddings):
    """A LangChain embedding model served by an in-process :class:`AsyncLLMEngine`."""

    model: str = Field(default_factory=lambda: os.environ.get("ASYNCENGINE_MODEL", "smollm2-135m-instruct"),
                       alias="model_name")
    """Model name, HF folder or ``.gguf`` file (env ``ASYNCENGINE_MODEL``)."""
    engine: Any = Field(default=None, exclude=True)
    """An AsyncLLMEngine to use instead of building one from ``model``."""
    engine_options: dict[str, Any] = Field(default_factory=dict)
    """EngineConfig fields for the engine built from ``model`` (e.g. ``{"dtype": "float32"}``)."""
    pooling: str | None = None
    """``last`` (None: the default, decoder embedding models), ``mean`` or ``cls``."""
    normalize: bool = True
    """L2-normalise each vector (after ``dimensions``)."""
    dimensions: int | None = None
    """Keep the first ``dimensions`` floats (Matryoshka models)."""
    query_prefix: str = ""
    """Text put before each query (e.g. Qwen3-Embedding's ``"Instruct: ...\\nQuery:"``)."""
    document_prefix: str = ""
    """Text put before each document."""

    _bridge: EngineBridge | None = PrivateAttr(default=None)

    model_config = {"populate_by_name": True, "arbitrary_types_allowed": True}

    @model_validator(mode="before")
    @classmethod
    def _model_from_engine(cls, values: Any) -> Any:
        return model_from_engine(values, "model")  # a given engine names the model

    @property
    def bridge(self) -> EngineBridge:
        return bridge_of(self, self.model)

    def _opts(self) -> tuple:
        return self.pooling, self.normalize, self.dimensions

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return embed_texts(self.bridge, [self.document_prefix + t for t in texts], *self._opts())

    def embed_query(self, text: str) -> list[float]:
        return embed_texts(self.bridge, [self.query_prefix + text], *self._opts())[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return await aembed_texts(self.bridge, [self.document_prefix + t for t in texts], *self._opts())

    async def aembed_query(self, text: str) -> list[float]:
        return (await aembed_texts(self.bridge, [self.query_prefix + text], *self._opts()))[0]


__all__ = ["AsyncEngineEmbeddings"]
