"""The K-quant kernels (Q4_K, Q5_K, Q6_K: kernels/cpu/quant_k.h, quant_k_isa.h) against gguf-py's
own dequantization of the same blocks (``gguf.quants.dequantize``), on every int8 path this CPU
can execute, forced in turn.

* dequantize and the embedding gather equal gguf-py's values exactly;
* fp32 activations: ``x @ dequant(W)^T`` up to fp32 summation error (test_quant_kernels' bound);
* q8_K activations: the C quantizer equals the torch reference bit for bit, the GEMM equals
  ``dequant(q8_K(x)) @ dequant(W)^T`` up to that bound, and every ISA gives the same bits.

Blocks are random but valid: random quant bytes and scale bytes, fp16 super-block scales in a sane
range (every byte pattern of the rest is a valid block).
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_quant_kernels import _isa_params, assert_matmul_close

from asyncengine.kernels.cpu import build, quant, quant_k, repack
from asyncengine.layers.linear import Linear, QuantizedTensor

K_FORMATS = ["Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(autouse=True)
def _kernels_on():
    assert quant.kernels_available(), f"the C kernels did not build: {build.build_error()}"


@pytest.fixture(params=_isa_params())
def isa(request):
    assert quant.set_isa(request.param) == request.param
    yield request.param
    quant.set_isa("auto")


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, k / 256 * block_bytes] of random valid ``qtype`` blocks."""
    g = np.random.default_rng(seed)
    bs = quant.QTYPES[qtype][1]
    b = g.integers(0, 256, size=(n, k // 256, bs), dtype=np.uint8)
    d = g.uniform(0.5e-3, 4e-3, size=(n, k // 256, 1)).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":
        b[..., 208:210] = d
    else:
        b[..., 0:2] = d
        b[..., 2:4] = g.uniform(0, 4e-3, size=(n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1).copy())


def gguf_dequant(w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    out = gguf.quants.dequantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(w.shape[0], k))


@pytest.mark.parametrize("qtype", K_FORMATS)
def test_dequantize_and_embedding_equal_gguf_py(qtype):
    w = random_blocks(qtype, 19, 512, seed=1)
    want = gguf_dequant(w, qtype, 512)
    assert torch.equal(quant.dequantize(w, qtype, 512), want)
    ids = torch.tensor([[3, 0], [18, 3]])
    assert torch.equal(quant.embedding(ids, w, qtype, 512), want[ids])


@pytest.mark.parametrize("qtype", K_FORMATS)
@pytest.mark.parametrize("m", [1, 3, 6, 50])
def test_fp32_activations_match_the_dequantized_matmul(qtype, m):
    k, n = 512, 21
    w = random_blocks(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    y = quant.gemm(x, w, qtype, k, bias, activations="fp32", fixed_order=True)
    assert_matmul_close(y, x, gguf_dequant(w, qtype, k), bias)


def test_q8k_activation_quantizer_matches_torch():
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(3)) * 3
    x[1, :256] = 0  # an all-zero block: d = 0, q = 0
    q, d = quant_k.quantize_activations_k(x)
    qr, dr = quant_k.quantize_activations_k_torch(x)
    assert torch.equal(q, qr) and torch.equal(d, dr)


@pytest.mark.parametrize("qtype", K_FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 13, 256), (4, 8, 512), (7, 33, 768)])
def test_int8_activations_each_isa(isa, qtype, m, n, k):
    w = random_blocks(qtype, n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
    bias = torch.randn(n)
    y = quant.gemm(x, w, qtype, k, bias, activations="int8")
    q, d = quant_k.quantize_activations_k_torch(x)
    xq = (q.float().reshape(m, k // 256, 256) * d.unsqueeze(-1)).reshape(m, k)
    assert_matmul_close(y, xq, gguf_dequant(w, qtype, k), bias)
    # and the same bits on every path: the scalar one is the reference
    quant.set_isa("scalar")
    try:
        assert torch.equal(quant.gemm(x, w, qtype, k, bias, activations="int8"), y)
    finally:
        quant.set_isa(isa)


@pytest.mark.parametrize("qtype", K_FORMATS)
def test_rows_are_batch_invariant(isa, qtype):
    k, n = 512, 16
    w = random_blocks(qtype, n, k, seed=5)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(9))
    full = quant.gemm(x, w, qtype, k, activations="int8")
    for i in (0, 4, 8):
        assert torch.equal(quant.gemm(x[i:i + 1], w, qtype, k, activations="int8"), full[i:i + 1])


def test_k_quants_keep_the_file_layout_and_refuse_bad_shapes():
    assert not repack.can_pack(64, "Q4_K")
    with pytest.raises(ValueError, match="multiple of 256"):
        quant.check(torch.zeros(2, 144, dtype=torch.uint8), "Q4_K", 128)
    with pytest.raises(ValueError, match="no Q6_K quantizer"):
        quant.quantize(torch.zeros(4, 256), "Q6_K")


@pytest.mark.parametrize("qtype", K_FORMATS)
def test_linear_keeps_k_blocks(qtype):
    k, n = 512, 24
    w = random_blocks(qtype, n, k, seed=7)
    layer = Linear(k, n)
    layer.quantize_as(qtype)
    layer.load(QuantizedTensor(qtype, (n, k), w))
    layer.set_activations("int8")
    assert not layer.packed and torch.equal(layer.qweight, w)
    x = torch.randn(2, k)
    assert torch.equal(layer(x), quant.gemm(x, w, qtype, k, activations="int8"))
    assert not Linear(k - 256 + 32, n).can_quantize(qtype)
