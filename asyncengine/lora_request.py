"""LoRARequest: which PEFT adapter a request runs under (vLLM's shape: name, integer id, path)."""
from __future__ import annotations

import msgspec

from asyncengine.errors import ConfigError


class LoRARequest(msgspec.Struct, frozen=True):
    """``id`` keys the adapter everywhere below the front end (slots, the prefix cache's block hash),
    so two adapters must never share one; ``name`` is what the OpenAI ``model`` field says."""

    name: str
    id: int
    path: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("LoRARequest.name must not be empty")
        if self.id < 1:
            raise ConfigError(f"LoRARequest.id must be >= 1 (0 is the base model), got {self.id}")
