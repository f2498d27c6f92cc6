"""A GGUF file in Hugging Face terms: a transformers config, HF-named float tensors, a tokenizer.

    ckpt = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.config            # LlamaConfig(architectures=["LlamaForCausalLM"], ...)
    ckpt.tensors           # {"model.embed_tokens.weight": float32 tensor, ...}, as in the HF checkpoint
    ckpt.tokenizer         # a transformers fast tokenizer, chat template included
    ckpt.eos_token_ids     # [2, 0]

The tests compare models built from it with transformers; the engine uses it for tensor-parallel
shards (``shard_of``) and otherwise opens files with the lighter ``open_gguf`` (model.py).
Anything wrong with the file raises :class:`ModelLoadError` naming the path.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

import torch

from asyncengine.errors import ModelLoadError
from asyncengine.models.gguf.config import SUPPORTED_ARCHITECTURES, architecture, build_config, fix_rope_from_freqs
from asyncengine.models.gguf.reader import GGUFFile, check_tensor_types, resolve_file
from asyncengine.models.gguf.dequant import load_tensors
from asyncengine.models.gguf.tensors import EXTRA_TENSORS, check_tensors, hf_tensors
from asyncengine.models.gguf.vocab import build_tokenizer, eos_token_ids

if typing.TYPE_CHECKING:
    import transformers

__all__ = ["GGUFCheckpoint", "gguf_config", "load_gguf", "tensor_types"]


@dataclasses.dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, in the terms a Hugging Face checkpoint would use."""

    config: "transformers.PretrainedConfig"
    tensors: dict[str, torch.Tensor]
    tokenizer: "transformers.PreTrainedTokenizerBase | None"
    eos_token_ids: list[int]
    # Tensors with no HF name (e.g. Llama 3's "rope_freqs"), under their GGUF names.
    extra_tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # The raw GGUF metadata (scalars and short arrays; the vocabulary arrays are left out).
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    path: str = ""


def gguf_config(path: str | os.PathLike) -> transformers.PretrainedConfig:
    """Only the model config of a GGUF file (its header; no tensor data is read)."""
    path = resolve_file(path)
    f = GGUFFile(path)
    arch = f.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES)}.")
    return build_config(f, arch, path)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, *, tensors: bool = True,
              tokenizer: bool = True, shard_of=None, keep_quantized: frozenset = frozenset()) -> GGUFCheckpoint:
    """Read a GGUF file (or a folder holding exactly one) into HF-named, dequantized tensors.

    ``dtype`` is what each tensor is cast to right after it is dequantized (float32 by default, which
    is exact for every GGUF type). ``tensors=False`` reads only the config and tokenizer (``tensors``
    is then empty). ``shard_of(hf_name) -> (dim, start, stop) | None``: a tensor-parallel rank's
    slice of each tensor; only those rows (or columns) of the memory map are dequantized.
    ``keep_quantized``: HF names of block-format tensors (Q4_0, Q4_1, Q8_0) to hand over as a
    ``QuantizedTensor`` (their slice of the raw blocks), not dequantized.
    Raises :class:`ModelLoadError` for a missing, truncated or corrupt file, an unsupported tensor type
    or an unsupported architecture.
    """
    path = resolve_file(path)
    gguf_file = GGUFFile(path)
    metadata = gguf_file.metadata
    gguf_arch = architecture(metadata, path)
    check_tensor_types(gguf_file, path)
    config = build_config(gguf_file, gguf_arch, path)
    if tensors:
        weights, extra = load_tensors(gguf_file, config, gguf_arch, path, dtype, shard_of,
                                      keep_quantized=keep_quantized)
    else:  # rope_freqs still matter for the config
        weights, extra = {}, load_tensors(gguf_file, config, gguf_arch, path, dtype, None,
                                          only=EXTRA_TENSORS)[1]
    del gguf_file  # every tensor is a copy: the memory map can go

    fix_rope_from_freqs(config, extra, path)
    if tensors and shard_of is None:
        check_tensors(config, weights, path)  # (a shard's shapes are checked by the model)
    tok = build_tokenizer(path, metadata) if tokenizer else None
    eos_ids = eos_token_ids(metadata, tok)
    return GGUFCheckpoint(
        config=config,
        tensors=weights,
        tokenizer=tok,
        eos_token_ids=eos_ids,
        extra_tensors=extra,
        metadata=metadata,
        path=path,
    )


def tensor_types(path: str | os.PathLike) -> dict[str, str]:
    """HF name -> GGUF type name (F32, Q4_1, ...) of every model tensor, from the header alone."""
    f = GGUFFile(resolve_file(path))
    arch = f.metadata.get("general.architecture", "llama")
    return {hf: t.type_name for hf, t, _, _ in hf_tensors(f, arch)}
