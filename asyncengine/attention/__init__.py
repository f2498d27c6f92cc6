"""The attention-backend seam: how the model runner's step batch becomes attention over the paged
KV cache. The runner picks one backend per engine (:func:`get_backend`), lets it shape the KV cache
and build one metadata object per step; every attention layer then calls
``meta.backend.forward(q, k, v, kv_cache, meta)``. Models never name a backend. The backends and
their capabilities are listed once, in registry.py.

Names resolve on first use, so the torch-free registry can be imported without the backends."""
__all__ = ["AttentionBackend", "SeqChunk", "StepBatch", "get_backend", "resolve_backend_name"]

_WHERE = {"AttentionBackend": "asyncengine.attention.backend", "SeqChunk": "asyncengine.attention.backend",
          "StepBatch": "asyncengine.attention.backend", "get_backend": "asyncengine.attention.selector",
          "resolve_backend_name": "asyncengine.config.attention"}


def __getattr__(name):
    if name in _WHERE:
        import importlib

        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'asyncengine.attention' has no attribute {name!r}")
