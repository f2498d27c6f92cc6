"""Reading llama.cpp's GGUF files: one idea per module, data flowing down the list.

* ``types``: the ggml tensor type table (ids, names, block sizes), our own copy of the file ABI;
* ``reader``: the file parser (metadata, tensor table, tensor bytes over a memory map);
* ``config``: metadata -> model config (and Llama 3 rope scaling back from ``rope_freqs``);
* ``tensors``: GGUF names -> HF names, q/k un-permuting, slicing for TP shards, dequantizing;
* ``vocab``: the tokenizer from the vocabulary metadata, and the end-of-generation ids;
* ``model``: :func:`open_gguf`, the engine's fast path (no transformers, no ``gguf`` import for
  the types it runs as they are);
* ``checkpoint``: :func:`load_gguf`, the whole file in Hugging Face terms (transformers config and
  tokenizer), for tensor-parallel shards and the tests' comparisons with transformers.
"""

from asyncengine.models.gguf.checkpoint import GGUFCheckpoint, gguf_config, load_gguf, tensor_types
from asyncengine.models.gguf.config import SUPPORTED_ARCHITECTURES, GGUFModelConfig
from asyncengine.models.gguf.model import GGUFModel, open_gguf
from asyncengine.models.gguf.tensors import unpermute_qk
from asyncengine.models.gguf.types import SUPPORTED_TENSOR_TYPES

__all__ = ["GGUFCheckpoint", "GGUFModel", "GGUFModelConfig", "SUPPORTED_ARCHITECTURES", "SUPPORTED_TENSOR_TYPES",
           "gguf_config", "load_gguf", "open_gguf", "tensor_types", "unpermute_qk"]
