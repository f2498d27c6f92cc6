"""LlamaIndex ``BaseEmbedding`` over an in-process AsyncLLMEngine (no HTTP hop): ``pip install asyncengine[llamaindex]``.

    from asyncengine.integrations.llamaindex_embeddings import AsyncEngineEmbedding
    emb = AsyncEngineEmbedding(model="smollm2-135m-instruct")
    emb.get_text_embedding_batch(["a cat sat on the mat", "stock prices fell"]);  await emb.aget_query_embedding("cats")

Each text is one ``engine.embed`` request, batched by the engine's scheduler with everything else
(a batch of ``embed_batch_size`` texts goes in at once); engines built from a model name are shared
with ``AsyncEngineLLM`` and the LangChain adapters (``engine_thread.shared_engine``).
"""
from __future__ import annotations

import os
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from pydantic import Field, PrivateAttr, model_validator

from .engine_thread import EngineBridge, aembed_texts, bridge_of, model_from_engine, embed_texts


class AsyncEngineEmbedding(BaseEmbedding):
    """A LlamaIndex embedding model served by an in-process :class:`AsyncLLMEngine`."""

    model_name: str = Field(default_factory=lambda: os.environ.get("ASYNCENGINE_MODEL", "smollm2-135m-instruct"),
                            alias="model", description="model name, HF folder or .gguf file")
    engine: Any = Field(default=None, exclude=True, description="an AsyncLLMEngine to use instead")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="EngineConfig fields")
    pooling: str | None = Field(default=None, description="last (None: the default), mean or cls")
    normalize: bool = Field(default=True, description="L2-normalise each vector (after dimensions)")
    dimensions: int | None = Field(default=None, description="keep the first N floats (Matryoshka models)")
    query_prefix: str = Field(default="", description="text put before each query (an instruction)")
    document_prefix: str = Field(default="", description="text put before each document")

    _bridge: EngineBridge | None = PrivateAttr(default=None)

    model_config = {"populate_by_name": True, "protected_namespaces": ()}

    @model_validator(mode="before")
    @classmethod
    def _model_from_engine(cls, values: Any) -> Any:
        return model_from_engine(values, "model_name")  # a given engine names the model

    @classmethod
    def class_name(cls) -> str:
        return "AsyncEngineEmbedding"

    @property
    def bridge(self) -> EngineBridge:
        return bridge_of(self, self.model_name)

    def _opts(self) -> tuple:
        return self.pooling, self.normalize, self.dimensions

    def _get_query_embedding(self, query: str) -> Embedding:
        return embed_texts(self.bridge, [self.query_prefix + query], *self._opts())[0]

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._get_text_embeddings([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return embed_texts(self.bridge, [self.document_prefix + t for t in texts], *self._opts())

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return (await aembed_texts(self.bridge, [self.query_prefix + query], *self._opts()))[0]

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return (await self._aget_text_embeddings([text]))[0]

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return await aembed_texts(self.bridge, [self.document_prefix + t for t in texts], *self._opts())


__all__ = ["AsyncEngineEmbedding"]
