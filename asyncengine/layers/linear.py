"""The one linear-layer seam every projection of a model goes through.

A :class:`Linear` holds its weight ``[out_features, in_features]`` in one of two storages:

* dense: an ``nn.Parameter`` named ``weight`` (fp32/bf16/fp16), run by ``F.linear``, as before;
* quantized: a GGUF block format (Q4_0, Q4_1, Q8_0) kept as the raw blocks, a uint8 buffer
  ``qweight [out_features, in_features // 32 * block_bytes]``, run by the CPU kernels
  (``asyncengine.kernels.cpu.quant``): single-stream decode is bound by the bytes of weight read
  per token, and 4.5-8.5 bits per weight read 4-7x fewer than fp32.

Which storage a layer uses is decided before its memory is allocated (:meth:`Linear.quantize_as`,
on the meta-device model); the loader then hands :meth:`Linear.load` either a dense tensor or a
:class:`QuantizedTensor`, for the whole weight or one fused part (q/k/v, gate/up), and the layer
converts when they differ (quantizes dense input, dequantizes blocks into a dense layer).

Tensor-parallel shards are slices of the checkpoint tensor (``LlamaForCausalLM.weight_shard``):
column-parallel layers take a slice of rows (output features), any row of blocks is a valid cut;
row-parallel layers take a slice of K (input features), which for a block format must fall on
32-element block edges: :meth:`QuantizedTensor.cols` says so when it does not.

:class:`VocabEmbedding` is the token embedding with the same storages; as the tied LM head it runs
the same matmul (:meth:`VocabEmbedding.logits`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.kernels.cpu import invariant, quant, repack
from asyncengine.layers import packed_linear

BLOCK_FORMATS = tuple(quant.QTYPES)  # GGUF block formats a layer can keep: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K


@dataclass
class QuantizedTensor:
    """A 2-D weight in a GGUF block format, as the loader hands it to a layer: ``data`` is uint8
    ``[rows, cols // 32 * block_bytes]`` (a view of the file's bytes, or a copy after a slice)."""

    qtype: str
    shape: tuple[int, int]  # (rows, cols) of the dense weight it stands for
    data: torch.Tensor

    def __post_init__(self) -> None:
        quant.check(self.data, self.qtype, self.shape[1])
        if self.data.shape[0] != self.shape[0]:
            raise ValueError(f"{self.qtype} data has {self.data.shape[0]} rows, shape says {self.shape[0]}")

    def rows(self, start: int, stop: int) -> "QuantizedTensor":
        """Rows [start, stop): a column-parallel shard (whole rows of blocks: always a clean cut)."""
        return QuantizedTensor(self.qtype, (stop - start, self.shape[1]), self.data[start:stop])

    def index_rows(self, index: torch.Tensor) -> "QuantizedTensor":
        """Rows in the order of ``index`` (the q/k un-permutation: whole rows, so exact)."""
        return QuantizedTensor(self.qtype, (len(index), self.shape[1]), self.data.index_select(0, index))

    def cols(self, start: int, stop: int) -> "QuantizedTensor":
        """Columns [start, stop): a row-parallel shard of K. Blocks (32 values, 256 for the K-quants)
        cannot be split."""
        blk = quant.block_len(self.qtype)
        if start % blk or stop % blk:
            raise ValueError(
                f"cannot take columns [{start}, {stop}) of a {self.qtype} weight: a row-parallel shard of a "
                f"block-quantized weight must start and end on {blk}-column block edges (here K is "
                f"split into slices of {stop - start}); use a tensor_parallel_size that gives each rank a "
                f"multiple of {blk} input features, or load with quantization='none'")
        bb = quant.QTYPES[self.qtype][1]
        data = self.data[:, start // blk * bb:stop // blk * bb].contiguous()
        return QuantizedTensor(self.qtype, (self.shape[0], stop - start), data)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return quant.dequantize(self.data, self.qtype, self.shape[1]).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class Linear(nn.Module):
    """``y = x W^T (+ b)``; W dense or in a GGUF block format. ``parts``: the row sizes of the
    checkpoint tensors fused into this one (q, k, v or gate, up), for :meth:`load`."""

    # fixed reduction order per output row, whatever M (layers/batch_invariant.py sets it)
    batch_invariant = False
    # bumped whenever a layer's activation mode or layout changes (the native step's table reads both)
    mode_epoch = 0
    # a dense weight in oneDNN's blocked layout (layers/packed_linear.py), or None
    onednn_weight: torch.Tensor | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parts: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parts = tuple(parts) if parts else (out_features,)
        if sum(self.parts) != out_features:
            raise ValueError(f"parts {self.parts} do not add up to {out_features} output features")
        # no init: the loader overwrites every weight (and on the meta device init is wasted work)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.qtype: str | None = None
        # quantized weights: "int8" | "fp32" activations, None = the process default (quant.ACTIVATIONS)
        self.activations: str | None = None
        # quantized weights: True when qweight holds the x8 layout (repack.pack), not the file's rows
        self.packed = False

    def can_quantize(self, qtype: str | None = None) -> bool:
        """Block formats need whole blocks (of 32 input features per row; 256 for the K-quants)."""
        return self.in_features % (quant.block_len(qtype) if qtype else quant.BLOCK) == 0

    def quantize_as(self, qtype: str) -> None:
        """Keep the weight in ``qtype`` blocks. Call before the weights are loaded (it drops the
        dense parameter); the buffer is created on the device of the dense one (meta is fine)."""
        if qtype not in quant.QTYPES:
            raise ValueError(f"unknown block format {qtype!r} (supported: {', '.join(quant.QTYPES)})")
        if not self.can_quantize(qtype):
            raise ValueError(f"{qtype} needs in_features to be a multiple of {quant.block_len(qtype)}, "
                             f"got {self.in_features}")
        device = self.weight.device if self.weight is not None else self.qweight.device
        self.weight = None
        self.qtype = qtype
        self.register_buffer("qweight", torch.empty(self.out_features, quant.row_bytes(qtype, self.in_features),
                                                    dtype=torch.uint8, device=device))
        # a float anchor, so that model.to(dtype) tells a quantized layer its activations' dtype
        self.register_buffer("_dtype_anchor", torch.empty(0, device=device), persistent=False)

    @property
    def quantized(self) -> bool:
        return self.qtype is not None

    def weight_nbytes(self) -> int:
        w = self.qweight if self.quantized else self.weight
        return w.numel() * w.element_size()

    def set_activations(self, mode: str | None) -> None:
        """``mode``: "int8" | "fp32" | None (the process default, ``quant.ACTIVATIONS``). A quantized
        weight then takes the layout its kernel is fastest on: the x8 layout for int8 (its integer
        kernel runs 1.4-2.5x faster on it: docs/cpu_decode.md), the file's rows for fp32 (whose kernel
        reads one row at a time and runs ~10% slower on x8). Both layouts give the same bits."""
        self.activations = mode
        self.relayout()
        Linear.mode_epoch += 1

    def relayout(self) -> None:
        """Repack (or unpack) the quantized weight in place for its activation mode (above)."""
        if not self.quantized or self.qweight.device.type != "cpu":
            return
        want = (self.activations or quant.ACTIVATIONS) == "int8" and repack.can_pack(self.out_features, self.qtype)
        if want != self.packed:
            with torch.no_grad():
                (repack.pack if want else repack.unpack)(self.qweight, self.qtype, self.in_features)
            self.packed = want

    def load(self, tensor: torch.Tensor | QuantizedTensor, part: int | None = None) -> None:
        """Copy a checkpoint weight (``part``: which fused part, None = the whole weight) into this
        layer, converting between dense and blocks when the storages differ (and between layouts:
        a packed weight is unpacked for the copy and packed again)."""
        if self.packed:
            with torch.no_grad():
                repack.unpack(self.qweight, self.qtype, self.in_features)
            self.packed = False
            try:
                self.load(tensor, part)
            finally:
                self.relayout()
                Linear.mode_epoch += 1
            return
        off = sum(self.parts[:part]) if part is not None else 0
        rows = self.parts[part] if part is not None else self.out_features
        shape = tuple(tensor.shape)
        if shape != (rows, self.in_features):
            raise ValueError(f"checkpoint shape {list(shape)} != {[rows, self.in_features]}")
        with torch.no_grad():
            if self.quantized:
                if isinstance(tensor, QuantizedTensor) and tensor.qtype == self.qtype:
                    blocks = tensor.data
                else:
                    dense = tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor
                    blocks = quant.quantize(dense, self.qtype)
                self.qweight.narrow(0, off, rows).copy_(blocks)
            else:
                dense = tensor.dequantize(self.weight.dtype) if isinstance(tensor, QuantizedTensor) else tensor
                self.weight.narrow(0, off, rows).copy_(dense)

    def load_bias(self, tensor: torch.Tensor, part: int | None = None) -> None:
        off = sum(self.parts[:part]) if part is not None else 0
        rows = self.parts[part] if part is not None else self.out_features
        if tuple(tensor.shape) != (rows,):
            raise ValueError(f"checkpoint bias shape {list(tensor.shape)} != {[rows]}")
        with torch.no_grad():
            self.bias.narrow(0, off, rows).copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qtype is None:
            if self.batch_invariant:
                return invariant.linear(x, self.weight, self.bias)
            if self.onednn_weight is not None and x.dtype == self.weight.dtype and x.device.type == "cpu":
                return packed_linear.linear(x, self.onednn_weight, self.bias, self.out_features)
            return F.linear(x, self.weight, self.bias)
        y = quant.gemm(x, self.qweight, self.qtype, self.in_features, self.bias, activations=self.activations,
                       fixed_order=self.batch_invariant, packed=self.packed)
        return y if y.dtype == self._dtype_anchor.dtype else y.to(self._dtype_anchor.dtype)

    def extra_repr(self) -> str:
        fmt = (self.qtype + (" x8" if self.packed else "")) if self.qtype else "dense"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {fmt}"


class VocabEmbedding(Linear):
    """Token embedding ``[rows, dim]`` (this rank's vocabulary slice); ``logits`` is the tied LM
    head, the same matmul a :class:`Linear` runs. ``valid_rows``: the rows the checkpoint fills
    (the last tensor-parallel rank's slice is shorter than the padded ``rows``)."""

    def __init__(self, rows: int, dim: int, valid_rows: int | None = None) -> None:
        super().__init__(dim, rows, bias=False)
        self.valid_rows = rows if valid_rows is None else valid_rows

    def load(self, tensor: torch.Tensor | QuantizedTensor, part: int | None = None) -> None:
        """The padding rows past ``valid_rows`` stay zero."""
        n = tensor.shape[0]
        if n == self.valid_rows < self.out_features and part is None:
            with torch.no_grad():
                (self.qweight if self.quantized else self.weight).zero_()
            self.parts = (n, self.out_features - n)
            try:
                super().load(tensor, 0)
            finally:
                self.parts = (self.out_features,)
            return
        super().load(tensor, part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qtype is None:
            return F.embedding(ids, self.weight)
        out = quant.embedding(ids, self.qweight, self.qtype, self.in_features, packed=self.packed)
        return out if out.dtype == self._dtype_anchor.dtype else out.to(self._dtype_anchor.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return Linear.forward(self, hidden)


def weight_nbytes(model: nn.Module) -> int:
    """Bytes of a model's weights as held: dense parameters plus quantized blocks."""
    quantized = sum(m.qweight.numel() for m in model.modules() if isinstance(m, Linear) and m.quantized)
    return quantized + sum(p.numel() * p.element_size() for p in model.parameters())
