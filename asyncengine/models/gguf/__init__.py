"""Reading llama.cpp's GGUF files: one idea per module, data flowing down the list.

* ``types``: the ggml tensor type table (ids, names, block sizes), our own copy of the file ABI;
* ``reader``: the file parser (metadata, tensor table, tensor bytes over a memory map);
* ``config``: metadata -> model config (and Llama 3 rope scaling back from ``rope_freqs``);
* ``moe``: mixture-of-experts files (Mixtral, qwen2moe, qwen3moe, olmoe): their config keys, the
  stacked expert tensors' names, one per expert, and their shapes;
* ``tensors``: GGUF names -> HF names, q/k row order, shape checks (no torch);
* ``dequant``: tensors as torch tensors (floats, or block views for the CPU kernels), slices for TP shards;
* ``vocab``: the tokenizer from the vocabulary metadata, and the end-of-generation ids;
* ``model``: :func:`open_gguf`, the engine's fast path (no transformers, no ``gguf`` import for
  the types it runs as they are);
* ``checkpoint``: :func:`load_gguf`, the whole file in Hugging Face terms (transformers config and
  tokenizer), for tensor-parallel shards and the tests' comparisons with transformers.

The names below are imported on first use: ``open_gguf`` (and everything it needs) imports no torch.
"""

_WHERE = {
    "GGUFCheckpoint": "checkpoint", "gguf_config": "checkpoint", "load_gguf": "checkpoint",
    "tensor_types": "checkpoint", "SUPPORTED_ARCHITECTURES": "config", "GGUFModelConfig": "config",
    "GGUFModel": "model", "open_gguf": "model", "unpermute_qk": "dequant", "SUPPORTED_TENSOR_TYPES": "types",
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
