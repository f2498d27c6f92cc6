"""The fingerprint of everything that changes a KV block's bytes besides its tokens.

Two caches may share a block only if they agree on the model's weights (identified by their files'
names, sizes and modification times, and config.json's contents: hashing gigabytes of weights at
every start would cost more than it saves), the KV dtype, the attention backend (it owns the
layout), the block size and the file format. Both sides of the connector compute it from the
config alone, so that they agree without a message.
"""
from __future__ import annotations

import hashlib
import os

from asyncengine.config.sub_configs import CacheConfig, ModelConfig

FORMAT_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def model_identity(path: str) -> list:
    """(name, size, mtime_ns) of each weight file, and config.json's bytes."""
    if os.path.isfile(path):
        st = os.stat(path)
        return [[os.path.basename(path), st.st_size, st.st_mtime_ns]]
    out: list = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.endswith(_WEIGHT_SUFFIXES):
            st = os.stat(full)
            out.append([name, st.st_size, st.st_mtime_ns])
        elif name == "config.json":
            with open(full, "rb") as f:
                out.append([name, hashlib.sha256(f.read()).hexdigest()])
    return out


def kv_fingerprint(model: ModelConfig, cache: CacheConfig, tensor_parallel_size: int) -> bytes:
    """32 bytes naming this engine's KV bytes (resolves the model view's device and dtype)."""
    from asyncengine.models.model_info import resolve_path  # lazy: reads the model's files only when a fingerprint is asked for

    parts = [f"asyncengine-kv-v{FORMAT_VERSION}", repr(model_identity(resolve_path(model.model))),
             str(model.torch_dtype), model.attention_backend_name, str(cache.block_size),
             str(tensor_parallel_size)]
    if cache.kv_cache_dtype != "auto":  # int8 rows + scales (16-bit caches keep their old fingerprints)
        parts.append(f"kv_cache_dtype={cache.kv_cache_dtype}")
    return hashlib.sha256("\n".join(parts).encode()).digest()
