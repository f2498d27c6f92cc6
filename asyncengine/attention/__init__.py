"""The attention-backend seam: how the model runner's step batch becomes attention over the paged
KV cache. The runner picks one backend per engine (:func:`get_backend`), lets it shape the KV cache
and build one metadata object per step; every attention layer then calls
``meta.backend.forward(q, k, v, kv_cache, meta)``. Models never name a backend."""
from asyncengine.attention.backend import AttentionBackend, SeqChunk, StepBatch
from asyncengine.attention.selector import get_backend, resolve_backend_name

__all__ = ["AttentionBackend", "SeqChunk", "StepBatch", "get_backend", "resolve_backend_name"]
