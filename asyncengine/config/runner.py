"""``EngineConfig.runner`` (vLLM's ``--runner``): what the engine is built to serve. "generate": a
decoder that generates (and embeds by its hidden states); "pooling": embeddings and scores only
(an encoder, a cross-encoder, a decoder used as an embedding model); "auto": the architecture
decides (models/pooling_models.py: BERT-family encoders pool, decoders generate)."""
from __future__ import annotations

from asyncengine.errors import ConfigError

RUNNERS = ("auto", "generate", "pooling")


def check_runner(runner: str) -> None:
    if runner not in RUNNERS:
        raise ConfigError(f"runner must be one of {', '.join(RUNNERS)}; got {runner!r}")
