"""LlamaIndex ``BaseNodePostprocessor`` that reranks retrieved nodes with a cross-encoder on an
in-process AsyncLLMEngine (no HTTP hop): ``pip install asyncengine[llamaindex]``.

    from asyncengine.integrations.llamaindex_rerank import AsyncEngineRerank
    rerank = AsyncEngineRerank(model="path/to/cross-encoder", top_n=3)
    query_engine = index.as_query_engine(node_postprocessors=[rerank])

Each (query, node text) pair is one ``engine.rerank`` request through the engine's scheduler; the
nodes come back best first, at most ``top_n``, each with the cross-encoder's relevance as its
``score`` (as LlamaIndex's SentenceTransformerRerank sets it)."""
from __future__ import annotations

import os
from typing import Any

from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
from pydantic import Field, PrivateAttr, model_validator

from .engine_thread import EngineBridge, arerank_texts, bridge_of, model_from_engine, rerank_texts


def _ranked(nodes: list[NodeWithScore], scores: list[float], top_n: int | None) -> list[NodeWithScore]:
    order = sorted(range(len(nodes)), key=lambda i: -scores[i])[:top_n]
    return [NodeWithScore(node=nodes[i].node, score=scores[i]) for i in order]


class AsyncEngineRerank(BaseNodePostprocessor):
    """A LlamaIndex node postprocessor served by an in-process :class:`AsyncLLMEngine` cross-encoder."""

    model_name: str = Field(default_factory=lambda: os.environ.get("ASYNCENGINE_MODEL", ""), alias="model",
                            description="a cross-encoder: HF folder")
    engine: Any = Field(default=None, exclude=True, description="an AsyncLLMEngine to use instead")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="EngineConfig fields")
    top_n: int | None = Field(default=3, description="nodes kept, best first (None: all, reordered)")

    _bridge: EngineBridge | None = PrivateAttr(default=None)

    model_config = {"populate_by_name": True, "protected_namespaces": ()}

    @model_validator(mode="before")
    @classmethod
    def _model_from_engine(cls, values: Any) -> Any:
        return model_from_engine(values, "model_name")  # a given engine names the model

    @classmethod
    def class_name(cls) -> str:
        return "AsyncEngineRerank"

    @property
    def bridge(self) -> EngineBridge:
        return bridge_of(self, self.model_name)

    @staticmethod
    def _texts(nodes: list[NodeWithScore]) -> list[str]:
        return [n.node.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        if query_bundle is None:
            raise ValueError("AsyncEngineRerank needs the query (a QueryBundle)")
        return _ranked(nodes, rerank_texts(self.bridge, query_bundle.query_str, self._texts(nodes)), self.top_n)

    async def _apostprocess_nodes(self, nodes: list[NodeWithScore],
                                  query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        if query_bundle is None:
            raise ValueError("AsyncEngineRerank needs the query (a QueryBundle)")
        scores = await arerank_texts(self.bridge, query_bundle.query_str, self._texts(nodes))
        return _ranked(nodes, scores, self.top_n)


__all__ = ["AsyncEngineRerank"]
