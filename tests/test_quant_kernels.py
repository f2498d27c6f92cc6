"""The quantized-weight kernels (kernels/cpu/quant.c via kernels/cpu/quant.py) and the Linear seam
(asyncengine/layers/linear.py), against torch references on the dequantized weights.

The kernels compute d * sum(q * x) + m * sum(x) per block in fp32, i.e. the dequantized dot product
re-associated: results must equal a float64 matmul on the dequantized weight to within fp32
summation error, which we bound per output by ``REL * sum_k |x_k| |w_nk|`` (not a loose rtol)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import gguf
import numpy as np
import pytest
import torch

from asyncengine.kernels.cpu import build, quant
from asyncengine.layers.linear import Linear, QuantizedTensor, VocabEmbedding

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]
REL = 2e-6  # x ~ 100 ops of fp32 rounding (eps 6e-8) on K <= 256: far below any real error


def assert_matmul_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None) -> None:
    ref = x.double() @ w.double().t()
    bound = x.double().abs() @ w.double().abs().t()
    if bias is not None:
        ref = ref + bias.double()
        bound = bound + bias.double().abs()
    err = (y.double() - ref).abs()
    worst = (err - REL * bound - 1e-7).max().item()
    assert worst <= 0, f"max error {err.max().item():.3g} exceeds the fp32 summation bound"


@pytest.fixture(autouse=True)
def _kernels_on():
    assert quant.kernels_available(), f"the C kernels did not build: {build.build_error()}"


@pytest.mark.parametrize("qtype", FORMATS)
def test_quantize_is_byte_identical_to_gguf_py(qtype):
    w = torch.randn(37, 160) * torch.rand(37, 1) * 3
    w[3, :32] = 0.0  # an all-zero block: d = 0
    mine = quant.quantize(w, qtype, rows_per_chunk=8)
    theirs = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    assert mine.shape == (37, quant.row_bytes(qtype, 160))
    assert torch.equal(mine, torch.from_numpy(np.ascontiguousarray(theirs)).view(torch.uint8).view(mine.shape))
    deq = gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType[qtype]).reshape(37, 160)
    assert torch.equal(quant.dequantize_torch(mine, qtype, 160), torch.from_numpy(deq.copy()))
    assert torch.equal(quant.dequantize(mine, qtype, 160), quant.dequantize_torch(mine, qtype, 160))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])  # quantization="int8" / "int4"
def test_round_trip_error_within_half_a_step(qtype):
    w = torch.randn(64, 256) * 0.05
    deq = quant.dequantize(quant.quantize(w, qtype), qtype, 256)
    blocks = w.view(64, 8, 32)
    if qtype == "Q8_0":
        step = blocks.abs().amax(-1, keepdim=True) / 127
        qmax, slack = 127, 0.0
    else:
        step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
        qmax, slack = 15, blocks.amin(-1, keepdim=True).abs() * 2 ** -10  # m is stored as fp16
    err = (deq.view(64, 8, 32) - blocks).abs()
    # half a step, plus what storing d in fp16 (relative error 2^-11) moves the top step by
    assert (err <= step * (0.5 + qmax * 2 ** -11) + slack + 1e-9).all()
    assert err.mean() < step.mean() * 0.3  # and on average well inside it


def _cases():
    rng = np.random.default_rng(0)
    out = []
    for qtype in FORMATS:
        for m in (1, 2, 3, 4, 5, 7, 16, 40):
            n = int(rng.choice([1, 7, 33, 65]))
            k = int(rng.choice([32, 96, 256]))
            out.append((qtype, m, n, k, bool(rng.integers(2))))
        out.append((qtype, quant.LARGE_M + 5, 67, 128, True))  # the tiled (dequantize + torch.mm) path
    return out


@pytest.mark.parametrize("qtype,m,n,k,bias", _cases())
def test_gemm_matches_dequantized_reference(qtype, m, n, k, bias):
    torch.manual_seed(m * 1000 + n + k)
    blocks = quant.quantize(torch.randn(n, k), qtype)
    w = quant.dequantize_torch(blocks, qtype, k)
    x = torch.randn(m, k)
    b = torch.randn(n) if bias else None
    y = quant.gemm(x, blocks, qtype, k, b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_matmul_close(y, x, w, b)
    if m < quant.LARGE_M:  # the register-blocked kernel itself (gemm would tile above LARGE_M)
        assert_matmul_close(quant.gemm_small_m(x, blocks, qtype, k), x, w)


def test_gemm_keeps_leading_dims_and_dtype():
    blocks = quant.quantize(torch.randn(9, 64), "Q8_0")
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    y = quant.gemm(x, blocks, "Q8_0", 64)
    assert y.shape == (2, 3, 9) and y.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="expects 64"):
        quant.gemm(torch.randn(2, 32), blocks, "Q8_0", 64)


@pytest.mark.parametrize("qtype", FORMATS)
def test_embedding_rows(qtype):
    blocks = quant.quantize(torch.randn(50, 96), qtype)
    ids = torch.tensor([[0, 49, 7], [7, 7, 3]])
    assert torch.equal(quant.embedding(ids, blocks, qtype, 96), quant.dequantize_torch(blocks, qtype, 96)[ids])
    with pytest.raises(IndexError):
        quant.embedding(torch.tensor([50]), blocks, qtype, 96)


@pytest.fixture
def kernels_off(monkeypatch):
    monkeypatch.setenv("ASYNCENGINE_CPU_KERNELS", "0")
    build._reset_for_tests()
    yield
    monkeypatch.delenv("ASYNCENGINE_CPU_KERNELS")
    build._reset_for_tests()


def test_torch_fallback_without_the_library(kernels_off):
    assert not quant.kernels_available() and "ASYNCENGINE_CPU_KERNELS" in build.build_error()
    for qtype in FORMATS:
        blocks = quant.quantize(torch.randn(33, 96), qtype)
        w = quant.dequantize_torch(blocks, qtype, 96)
        x, b = torch.randn(5, 96), torch.randn(33)
        assert_matmul_close(quant.gemm(x, blocks, qtype, 96, b), x, w, b)
        assert torch.equal(quant.dequantize(blocks, qtype, 96), w)
        assert torch.equal(quant.embedding(torch.tensor([3, 1]), blocks, qtype, 96), w[[3, 1]])
    layer = Linear(96, 33)
    layer.quantize_as("Q4_1")
    layer.load(torch.randn(33, 96))
    x = torch.randn(4, 96)
    assert_matmul_close(layer(x), x, quant.dequantize_torch(layer.qweight, "Q4_1", 96))


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the portable path")
def test_portable_scalar_path(tmp_path):
    """quant.c built without -march (no AVX2 macros: the scalar loops) agrees with the reference."""
    so = tmp_path / "quant_scalar.so"
    subprocess.run(["cc", "-O2", "-fopenmp", "-fPIC", "-shared", "-std=c11", str(build.SOURCE_DIR / "quant.c"),
                    str(build.SOURCE_DIR / "runtime.c"), "-o", str(so), "-lm"], check=True, timeout=120)
    lib = ctypes.CDLL(str(so))
    assert lib.ae_simd_level() == 0
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ae_q_gemm.argtypes = [ctypes.c_int, p, i64, i64, p, i64, p, p, i64, ctypes.c_int, ctypes.c_int]
    for qtype in FORMATS:
        blocks = quant.quantize(torch.randn(21, 128), qtype)
        x, b = torch.randn(6, 128), torch.randn(21)
        out = torch.full((6, 21), 1.0)
        rc = lib.ae_q_gemm(quant.QTYPES[qtype][0], x.data_ptr(), 6, 128, blocks.data_ptr(), 21, b.data_ptr(),
                           out.data_ptr(), 21, 1, 2)  # accumulate onto the ones
        assert rc == 0
        assert_matmul_close(out - 1.0, x, quant.dequantize_torch(blocks, qtype, 128), b)


# ----------------------------------------------------------------------------------- the seam


def test_linear_converts_between_dense_and_blocks():
    torch.manual_seed(0)
    w = torch.randn(10, 64)
    blocks = QuantizedTensor("Q8_0", (10, 64), quant.quantize(w, "Q8_0"))
    deq = quant.dequantize_torch(blocks.data, "Q8_0", 64)
    # quantized layer, fused parts (6 + 4 rows), one part given as blocks, one dense
    q = Linear(64, 10, bias=True, parts=(6, 4))
    q.quantize_as("Q8_0")
    assert q.weight is None and q.qweight.dtype == torch.uint8
    q.load(blocks.rows(0, 6), 0)
    q.load(w[6:], 1)
    q.load_bias(torch.zeros(6), 0)
    q.load_bias(torch.ones(4), 1)
    assert torch.equal(q.qweight, blocks.data)  # dense rows quantized exactly as the file's would be
    x = torch.randn(3, 64)
    assert_matmul_close(q(x), x, deq, torch.tensor([0.0] * 6 + [1.0] * 4))
    assert q.weight_nbytes() == 10 * 2 * 34
    # dense layer handed blocks: dequantized on load
    d = Linear(64, 10)
    d.load(blocks)
    assert torch.equal(d.weight.detach(), deq)
    with pytest.raises(ValueError, match="checkpoint shape"):
        d.load(w[:, :32])


def test_row_parallel_slice_must_fall_on_block_edges():
    blocks = QuantizedTensor("Q4_1", (4, 128), quant.quantize(torch.randn(4, 128), "Q4_1"))
    half = blocks.cols(64, 128)
    assert half.shape == (4, 64)
    assert torch.equal(half.dequantize(), blocks.dequantize()[:, 64:])
    with pytest.raises(ValueError, match="32-column block edges"):
        blocks.cols(16, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        Linear(48, 4).quantize_as("Q8_0")


def test_vocab_embedding_pads_a_short_slice_and_is_the_tied_head():
    table = torch.randn(5, 32)
    emb = VocabEmbedding(8, 32, valid_rows=5)  # the last TP rank: 5 real rows of 8
    emb.quantize_as("Q8_0")
    emb.load(QuantizedTensor("Q8_0", (5, 32), quant.quantize(table, "Q8_0")))
    deq = quant.dequantize_torch(emb.qweight, "Q8_0", 32)
    assert torch.equal(deq[5:], torch.zeros(3, 32))
    assert torch.equal(emb(torch.tensor([4, 0])), deq[[4, 0]])
    h = torch.randn(2, 32)
    assert_matmul_close(emb.logits(h), h, deq)
    with pytest.raises(ValueError, match="checkpoint shape"):  # any other short table is an error
        VocabEmbedding(8, 32).load(table)
    emb.to(torch.bfloat16)
    assert emb(torch.tensor([1])).dtype == torch.bfloat16
