"""Which attention backend an engine uses: ``EngineConfig.attention_backend``, resolved against the
table in registry.py, built with the runner's shapes."""
from __future__ import annotations

import importlib

from asyncengine.attention.backend import AttentionBackend
from asyncengine.config.attention import backend_info, resolve_backend_name

__all__ = ["get_backend", "resolve_backend_name"]


def get_backend(name: str, **kwargs) -> AttentionBackend:
    """Build the backend ``name`` (already resolved, not "auto") with the runner's shapes."""
    module, _, cls = backend_info(name).path.partition(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
