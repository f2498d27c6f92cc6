"""The engine's way into a GGUF file: config and tokenizer at once, weights one tensor at a time.

:func:`open_gguf` builds no transformers object and imports no ``gguf`` package for the types the
engine runs from the file's own bytes (F32/F16/BF16, Q4_0, Q4_1, Q8_0): the default model's start.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Iterator

from asyncengine.errors import ModelLoadError
from asyncengine.models.gguf.config import GGUFModelConfig, architecture, config_kwargs, fix_rope_from_freqs
from asyncengine.models.gguf.reader import GGUFFile, check_tensor_types, open_file, resolve_file
from asyncengine.models.gguf.tensors import (
    EXTRA_TENSORS,
    PERMUTED_QK_ARCHITECTURES,
    check_tensor_names,
    check_tensors,
    hf_tensors,
    norm_shift,
    unpermute_rows,
)
from asyncengine.models.gguf.types import KEPT_AS_BLOCKS
from asyncengine.models.gguf.vocab import build_tokenizer, eos_token_ids, fast_tokenizer

if TYPE_CHECKING:
    import torch

__all__ = ["GGUFModel", "open_gguf"]


@dataclasses.dataclass
class GGUFModel:
    """A GGUF file opened for the engine: config and tokenizer ready, weights made on demand."""

    config: GGUFModelConfig
    tokenizer: Any
    eos_token_ids: list[int]
    metadata: dict[str, Any]
    path: str
    tensor_types: dict[str, str]  # HF name -> GGUF type name (F32, Q4_1, ...)
    _file: GGUFFile = dataclasses.field(repr=False, default=None)
    _permute: bool = False
    gguf_arch: str = "llama"  # the file's general.architecture (tensor names depend on it)

    def weights(self, dtype: torch.dtype | None = None, keep_quantized: frozenset = frozenset()
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor in ``dtype``) pairs, each dequantized only when it is asked for, so that
        at most one float copy of one tensor exists beyond what the caller keeps. Tensors named in
        ``keep_quantized`` (and stored in a block format the CPU kernels run) come as a
        ``QuantizedTensor``: a view of the file's bytes (a copy only for permuted q/k rows)."""
        import torch

        from asyncengine.models.gguf import dequant  # lazy: GGUF reading only for a .gguf model

        dtype = dtype or torch.float32
        f, cfg = self._file, self.config
        stacked = None  # (tensor, its dequantized experts): a stacked expert tensor is decoded once
        for hf, t, expert, shape in hf_tensors(f, self.gguf_arch):
            if expert is not None:  # one expert of a stacked [E, ...] tensor (gguf/moe.py)
                if hf in keep_quantized and t.type_name in KEPT_AS_BLOCKS:
                    yield hf, dequant.expert_view(f, t, expert)
                else:
                    if stacked is None or stacked[0] is not t:
                        stacked = (t, dequant.dequantize_torch(f, t, self.path, dtype))
                    yield hf, stacked[1][expert]
                if expert == t.shape[0] - 1:
                    stacked = None
                    f.release(t)
                continue
            permuted = self._permute and (".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf)
            rows = None
            if permuted:
                rows = torch.from_numpy(unpermute_rows(t.shape[0], cfg.num_attention_heads if ".q_proj." in hf
                                                       else cfg.num_key_value_heads))
            if hf in keep_quantized and t.type_name in KEPT_AS_BLOCKS:
                w = dequant.quantized_view(f, t)
                yield hf, (w.index_rows(rows) if permuted else w)  # whole rows of blocks: exact
            else:
                shift = norm_shift(self.gguf_arch, hf)
                w = dequant.dequantize_torch(f, t, self.path, torch.float32 if shift else dtype)
                if shift:  # Gemma: the converter's 1 + weight, undone in fp32
                    w = (w + shift).to(dtype)
                if permuted:
                    w = w.index_select(0, rows)
                yield hf, (w if w.dim() == len(shape) else w.reshape(shape))
            f.release(t)  # the caller has copied it: its file pages need not count in our RSS


def open_gguf(path: str | os.PathLike, *, tokenizer: bool = True) -> GGUFModel:
    """Open a GGUF file for the engine: metadata, config and tokenizer now (milliseconds for the
    config, ~0.2 s for a 50k byte-level vocabulary), weights when :meth:`GGUFModel.weights` is
    consumed. Checks what :func:`~asyncengine.models.gguf.checkpoint.load_gguf` checks, from the tensor table, before any weight is read."""
    path = resolve_file(path)
    f = open_file(path)
    md = f.metadata
    gguf_arch = architecture(md, path)
    check_tensor_types(f, path)
    model_type, kwargs = config_kwargs(f, gguf_arch, path)
    config = GGUFModelConfig(model_type, **kwargs)
    check_tensor_names(f, gguf_arch, path)
    extra = {t.name.removesuffix(".weight"): f.floats(t) for t in f.tensors if t.name in EXTRA_TENSORS}
    fix_rope_from_freqs(config, extra, path)
    shapes = {hf: shape for hf, _, _, shape in hf_tensors(f, gguf_arch)}
    check_tensors(config, shapes, path)
    permute = gguf_arch in PERMUTED_QK_ARCHITECTURES
    if permute:
        for name, shape in shapes.items():
            if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
                heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
                if shape[0] % (2 * heads):
                    raise ModelLoadError(f"{path}: tensor {name!r} of shape {list(shape)}: {shape[0]} rows cannot "
                                         f"be split into {heads} heads of an even size.")
    tok = None
    if tokenizer:
        tok = fast_tokenizer(f, md)
        if tok is None:  # not a vocabulary the fast path knows: transformers' conversion
            tok = build_tokenizer(path, md)
    return GGUFModel(config=config, tokenizer=tok, eos_token_ids=eos_token_ids(md, tok), metadata=md, path=path,
                     tensor_types={hf: t.type_name for hf, t, _, _ in hf_tensors(f, gguf_arch)},
                     _file=f, _permute=permute, gguf_arch=gguf_arch)
