"""A GGUF file's tensors back in Hugging Face's terms: names, row order, float values.

What llama.cpp's ``convert_hf_to_gguf.py`` changed, and what this module undoes:

* names: ``blk.N.attn_q.weight`` <- ``model.layers.N.self_attn.q_proj.weight`` and so on (``_LAYER_NAMES``);
* for the ``llama`` architecture only, the rows of ``q_proj`` and ``k_proj`` (weight and bias) were
  permuted per head, from HF's "rotate half" rope layout to GGML's interleaved pairs
  (``reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2)``). We apply the inverse, with the number of
  KV heads for ``k_proj``. Qwen2/Qwen3 use GGML's NEOX rope, so nothing was permuted there;
* weights are stored quantized; we turn them back to float32 (the engine's ``dequantize_torch``:
  torch for F32/F16/BF16, Q8_0, Q4_0 and Q4_1, ``gguf.quants``, imported only then, for the others;
  ``load_tensors``, for ``load_gguf``: ``gguf.quants`` throughout) or hand the CPU kernels' block
  formats over as they are (``QuantizedTensor``). The permutation is over whole rows and the
  quantization blocks run along a row, so un-permuting after dequantizing (or on whole rows of
  blocks) is exact.

A tensor-parallel rank reads only its slice of each tensor (``shard_of``) from the memory map.
"""

from __future__ import annotations

import re
import typing

import numpy as np
import torch

from asyncengine.errors import ModelLoadError
from asyncengine.models.gguf.types import BLOCK_FORMATS, BLOCK_SIZES, GGMLType

if typing.TYPE_CHECKING:
    from asyncengine.models.gguf.reader import GGUFFile, TensorInfo

__all__ = ["EXTRA_TENSORS", "PERMUTED_QK_ARCHITECTURES", "check_tensor_names", "check_tensors", "dequantize_torch",
           "hf_name", "load_tensors", "quantized_view", "unpermute_qk", "unpermute_rows"]

# Architectures whose q/k rows llama.cpp permuted for its interleaved ("normal") rope.
PERMUTED_QK_ARCHITECTURES = {"llama"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
# GGUF tensors kept under their own names in `extra_tensors` (they have no HF counterpart).
EXTRA_TENSORS = {"rope_freqs.weight"}


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for a name with no HF
    counterpart (``rope_freqs.weight``, or a tensor of an architecture we do not know)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute(w, n_head)``: GGML's interleaved rope rows back to HF's halves.

    llama.cpp wrote ``w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2)``: per head, HF row ``i`` of
    the first half and row ``i`` of the second half became rows ``2i`` and ``2i + 1``. Works on a
    weight (rows, cols) and on a bias (rows,). For ``k_proj`` pass the number of KV heads.
    """
    return w.index_select(0, torch.from_numpy(unpermute_rows(w.shape[0], n_head)))


def unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: ``hf = gguf[index]``."""
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of an even size")
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def _slice_raw(f: GGUFFile, t: TensorInfo, spec, qtype):
    """Dequantize only rows [start, stop) (dim 0) or columns [start, stop) (dim 1) of a tensor
    straight from the memory map. Quantized rows are independent, so a row slice is a slice of the
    bytes; a column slice is one too when it falls on quantization-block edges, and otherwise is
    dequantized a few rows at a time (never the whole tensor at once)."""
    from gguf.quants import dequantize

    dim, start, stop = spec
    raw = f.raw(t)
    if dim == 0:
        part = raw[start:stop]
        return dequantize(np.ascontiguousarray(part), qtype).reshape((stop - start,) + tuple(t.shape[1:]))
    if dim != 1 or len(t.shape) != 2:
        raise ModelLoadError(f"{f.path}: cannot shard tensor {t.name!r} of shape {list(t.shape)} along dim {dim}")
    block, type_size = BLOCK_SIZES[t.type_id]
    rows, cols = t.shape
    if start % block == 0 and stop % block == 0:
        part = np.ascontiguousarray(raw[:, start // block * type_size:stop // block * type_size])
        return dequantize(part, qtype).reshape(rows, stop - start)
    out = np.empty((rows, stop - start), dtype=np.float32)
    for r0 in range(0, rows, 256):
        r1 = min(rows, r0 + 256)
        out[r0:r1] = dequantize(np.ascontiguousarray(raw[r0:r1]), qtype).reshape(r1 - r0, cols)[:, start:stop]
    return out


def check_tensor_names(f: GGUFFile, gguf_arch: str, path: str) -> None:
    """Refuse a file with a tensor we would not know what to do with (not a plain model of its architecture)."""
    unknown = [t.name for t in f.tensors if hf_name(t.name) is None and t.name not in EXTRA_TENSORS]
    if unknown:
        raise ModelLoadError(
            f"{path}: {len(unknown)} tensor(s) have no known meaning for architecture {gguf_arch!r} "
            f"(e.g. {', '.join(unknown[:5])}); this file is not a plain {gguf_arch} model."
        )


def load_tensors(f: GGUFFile, config, gguf_arch: str, path: str, dtype: torch.dtype, shard_of=None,
                 only=None, keep_quantized: frozenset = frozenset()):
    """(HF-named tensors, extra tensors under their GGUF names), all read now, dequantized with
    ``gguf.quants`` (for ``load_gguf``: the Hugging Face view and tensor-parallel shards)."""
    import gguf
    from gguf.quants import dequantize

    check_tensor_names(f, gguf_arch, path)
    permute = gguf_arch in PERMUTED_QK_ARCHITECTURES
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    tensors: dict[str, torch.Tensor] = {}
    extra: dict[str, torch.Tensor] = {}
    for t in f.tensors:
        if only is not None and t.name not in only:
            continue
        hf = hf_name(t.name)
        spec = shard_of(hf) if shard_of is not None and hf is not None else None
        qtype = gguf.GGMLQuantizationType(t.type_id)
        if hf in keep_quantized and t.type_name in BLOCK_FORMATS:
            tensors[hf] = _quantized_shard(f, t, hf, spec, permute, n_head, n_kv)
            continue
        try:
            if spec is None:
                array = dequantize(f.raw(t), qtype).reshape(t.shape)
            else:
                array = _slice_raw(f, t, spec, qtype)
        except NotImplementedError as exc:
            raise ModelLoadError(f"{path}: tensor {t.name!r} has type {t.type_name}, which cannot be "
                                 f"dequantized here ({exc}).") from None
        if permute and hf is not None and (".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf):
            heads = n_head if ".q_proj." in hf else n_kv
            if spec is not None:  # whole heads of rows: unpermute within this rank's heads
                heads = heads * array.shape[0] // t.shape[0]
            try:
                rows = unpermute_rows(array.shape[0], heads)
            except ValueError as exc:
                raise ModelLoadError(f"{path}: tensor {t.name!r} of shape {list(t.shape)}: {exc}.") from None
            array = array[rows]  # a gather: a fresh array
        if not array.flags.writeable or not array.flags.c_contiguous or array.dtype != np.float32:
            array = np.array(array, dtype=np.float32, order="C")  # F32/F16 can still be views of the map
        tensor = torch.from_numpy(array)
        if tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        if hf is None:
            extra[t.name.removesuffix(".weight")] = tensor
        else:
            tensors[hf] = tensor
    return tensors, extra


def _quantized_shard(f: GGUFFile, t: TensorInfo, hf: str, spec, permute: bool, n_head: int, n_kv: int):
    """This rank's slice of a block-format tensor, still in blocks: rows are a byte slice, a K slice
    must fall on block edges (``QuantizedTensor.cols`` raises otherwise); q/k rows un-permuted
    within this rank's heads."""
    q = quantized_view(f, t)
    if spec is not None:
        dim, start, stop = spec
        try:
            q = q.rows(start, stop) if dim == 0 else q.cols(start, stop)
        except ValueError as exc:
            raise ModelLoadError(f"{f.path}: tensor {t.name!r}: {exc}") from None
    if permute and (".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf):
        heads = (n_head if ".q_proj." in hf else n_kv) * q.shape[0] // t.shape[0]
        q = q.index_rows(torch.from_numpy(unpermute_rows(q.shape[0], heads)))
    return q


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
    h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.model_type == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


def check_tensors(config, tensors: dict[str, torch.Tensor], path: str) -> None:
    expected = _expected_shapes(config)
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ModelLoadError(
            f"{path}: {len(missing)} tensor(s) the {config.architectures[0]} config calls for are missing from "
            f"the file (e.g. {', '.join(missing[:4])})."
        )
    def shape(n):  # tensors, or their shapes
        return tuple(tensors[n]) if isinstance(tensors[n], tuple) else tuple(tensors[n].shape)

    wrong = [f"{n} is {list(shape(n))}, expected {list(s)}" for n, s in expected.items() if shape(n) != s]
    if wrong:
        raise ModelLoadError(f"{path}: tensor shapes do not match the metadata: {'; '.join(wrong[:4])}.")


def quantized_view(f: GGUFFile, t: TensorInfo):
    """A 2-D block-format tensor as a ``QuantizedTensor`` over the memory map (no copy; layers copy out of it)."""
    from asyncengine.layers.linear import QuantizedTensor

    rows, cols = t.shape
    return QuantizedTensor(t.type_name, (rows, cols), f.torch_bytes(t).view(rows, -1))


def dequantize_torch(f: GGUFFile, t: TensorInfo, path: str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor as a fresh ``dtype`` tensor. F32/F16/BF16, Q8_0, Q4_0 and Q4_1 are decoded with
    torch (multi-threaded, no float64 detour, no ``gguf`` import); other types go through ``gguf.quants``."""
    qt = t.type_id
    shape = t.shape
    if qt in _TORCH_FLOATS:
        return f.torch_bytes(t).view(_TORCH_FLOATS[qt]).view(shape).to(dtype, copy=True)
    if qt in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1):
        b = f.torch_bytes(t).view(-1, BLOCK_SIZES[qt][1])
        d = b[:, 0:2].contiguous().view(torch.float16).to(torch.float32)  # [blocks, 1]
        if qt == GGMLType.Q8_0:
            w = b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d
        else:
            qs = b[:, 4:] if qt == GGMLType.Q4_1 else b[:, 2:]
            q = torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.float32)  # elements 0-15, then 16-31
            if qt == GGMLType.Q4_1:
                m = b[:, 2:4].contiguous().view(torch.float16).to(torch.float32)
                w = torch.addcmul(m, q, d)
            else:
                w = (q - 8.0) * d
        return w.view(shape).to(dtype)
    import gguf

    try:
        array = gguf.quants.dequantize(f.raw(t), gguf.GGMLQuantizationType(qt))
    except NotImplementedError as exc:
        raise ModelLoadError(f"{path}: tensor {t.name!r} has type {t.type_name}, which cannot be "
                             f"dequantized here ({exc}).") from None
    return torch.from_numpy(np.ascontiguousarray(array.reshape(shape), dtype=np.float32)).to(dtype)


_TORCH_FLOATS = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}
