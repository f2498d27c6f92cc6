"""GGUF tensors as torch tensors: float values (``dequantize_torch``: torch for F32/F16/BF16, Q8_0,
Q4_0 and Q4_1, ``gguf.quants``, imported only then, for the others), block-format views for the
CPU kernels (``quantized_view``), and the whole-file read with ``gguf.quants`` that ``load_gguf``
uses for the Hugging Face view and tensor-parallel shards (``load_tensors``: a rank reads only its
slice of each tensor from the memory map)."""

from __future__ import annotations

import typing

import numpy as np
import torch

from asyncengine.errors import ModelLoadError
from asyncengine.layers.linear import QuantizedTensor
from asyncengine.models.gguf.tensors import (
    PERMUTED_QK_ARCHITECTURES,
    check_tensor_names,
    hf_name,
    norm_shift,
    unpermute_rows,
)
from asyncengine.models.gguf.moe import expert_names
from asyncengine.models.gguf.types import BLOCK_SIZES, KEPT_AS_BLOCKS, GGMLType

if typing.TYPE_CHECKING:
    from asyncengine.models.gguf.reader import GGUFFile, TensorInfo

__all__ = ["dequantize_torch", "expert_view", "load_tensors", "quantized_view", "unpermute_qk"]


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute(w, n_head)``: GGML's interleaved rope rows back to HF's halves.

    llama.cpp wrote ``w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2)``: per head, HF row ``i`` of
    the first half and row ``i`` of the second half became rows ``2i`` and ``2i + 1``. Works on a
    weight (rows, cols) and on a bias (rows,). For ``k_proj`` pass the number of KV heads.
    """
    return w.index_select(0, torch.from_numpy(unpermute_rows(w.shape[0], n_head)))


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
        hf = hf_name(t.name, gguf_arch)
        per = expert_names(hf, t.shape[0]) if hf is not None and len(t.shape) == 3 else None
        if per is not None:  # a stacked expert tensor: one tensor per expert (gguf/moe.py)
            tensors.update(_expert_tensors(f, t, per, shard_of, keep_quantized, dtype))
            continue
        spec = shard_of(hf) if shard_of is not None and hf is not None else None
        qtype = gguf.GGMLQuantizationType(t.type_id)
        if hf in keep_quantized and t.type_name in KEPT_AS_BLOCKS:
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
        if hf is not None and norm_shift(gguf_arch, hf):
            array = array + np.float32(norm_shift(gguf_arch, hf))  # Gemma: the converter's 1 + weight, in fp32
        if hf is not None and hf.endswith(".shared_expert_gate.weight") and array.ndim == 1:
            array = array.reshape(1, -1)  # (llama-quantize's [H] for [1, H])
        tensor = torch.from_numpy(array)
        if tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        if hf is None:
            extra[t.name.removesuffix(".weight")] = tensor
        else:
            tensors[hf] = tensor
    return tensors, extra


def _expert_tensors(f: GGUFFile, t: TensorInfo, names: list[str], shard_of, keep_quantized, dtype):
    """(per-expert name, tensor: this rank's slice, dequantized or still blocks) of a stacked tensor;
    an expert whose slice is empty (another rank's, under expert parallel) is left out."""
    dense = None
    for e, name in enumerate(names):
        spec = shard_of(name) if shard_of is not None else None
        if spec is not None and spec[2] <= spec[1]:
            continue
        if name in keep_quantized and t.type_name in KEPT_AS_BLOCKS:
            q = expert_view(f, t, e)
            if spec is not None:
                try:
                    q = q.rows(spec[1], spec[2]) if spec[0] == 0 else q.cols(spec[1], spec[2])
                except ValueError as exc:
                    raise ModelLoadError(f"{f.path}: tensor {t.name!r}: {exc}") from None
            yield name, q
            continue
        if dense is None:
            dense = dequantize_torch(f, t, f.path, dtype)
        w = dense[e] if spec is None else dense[e].narrow(spec[0], spec[1], spec[2] - spec[1])
        yield name, w.contiguous()


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


def quantized_view(f: GGUFFile, t: TensorInfo):
    """A 2-D block-format tensor as a ``QuantizedTensor`` over the memory map (no copy; layers copy out of it)."""

    rows, cols = t.shape
    if t.type_name == "Q5_0":
        return QuantizedTensor("Q8_0", (rows, cols), q5_0_as_q8_0(f.torch_bytes(t).view(rows, -1)))
    return QuantizedTensor(t.type_name, (rows, cols), f.torch_bytes(t).view(rows, -1))


def q5_0_as_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks ([rows, n * 22] bytes: fp16 d, 32 high bits, 16 bytes of low nibbles) as Q8_0
    blocks ([rows, n * 34]: the same d, 32 int8 ``q - 16``): the same values exactly. llama-quantize
    writes Q5_0 for the rows of a K-quant file that are not whole 256-value super-blocks; no kernel
    of ours reads Q5_0, and a dequantized copy would cost 32 bits a weight."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 22)
    qh = b[..., 2:6].to(torch.int64)
    qh = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24  # element k's fifth bit: bit k
    hi = ((qh.unsqueeze(-1) >> torch.arange(32)) & 1) << 4
    qs = b[..., 6:22]
    lo = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int64)  # elements 0-15, then 16-31
    q8 = ((lo | hi) - 16).to(torch.int8).view(torch.uint8)
    return torch.cat([b[..., 0:2], q8], dim=-1).reshape(rows, -1)


def expert_view(f: GGUFFile, t: TensorInfo, expert: int):
    """Expert ``expert`` of a stacked block-format tensor [E, rows, cols] as a ``QuantizedTensor``:
    its rows are a contiguous run of whole blocks, so a view of the map (no copy)."""

    n, rows, cols = t.shape
    raw = f.torch_bytes(t).view(n * rows, -1)
    whole = (QuantizedTensor("Q8_0", (n * rows, cols), q5_0_as_q8_0(raw)) if t.type_name == "Q5_0"
             else QuantizedTensor(t.type_name, (n * rows, cols), raw))
    return whole.rows(expert * rows, (expert + 1) * rows)


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
