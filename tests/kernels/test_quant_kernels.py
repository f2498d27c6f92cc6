"""The quantized-weight kernels (kernels/cpu/quant.c via kernels/cpu/quant.py) and the Linear seam
(asyncengine/layers/linear.py), against torch references on the dequantized weights.

The kernels compute d * sum(q * x) + m * sum(x) per block in fp32, i.e. the dequantized dot product
re-associated: results must equal a float64 matmul on the dequantized weight to within fp32
summation error, which we bound per output by ``REL * sum_k |x_k| |w_nk|`` (not a loose rtol).

The int8-activation path (``activations="int8"``) multiplies the same weights with x rounded to int8
blocks: it is held to the same bound against "dequantized W times the int8-rounded x" (a check of
the integer math), and to the rounding's own worst case against the plain fp32 product. The fp32
path is called explicitly where it is the one under test."""
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


def _isa_params():
    """Every int8 path: those this CPU cannot execute are skipped, saying so."""
    best = quant.ISAS.index(quant.cpu_isa()) if quant.kernels_available() else 0
    return [pytest.param(name, marks=pytest.mark.skipif(
        i > best, reason=f"this CPU (or its OS) cannot execute {name}; the best it can is {quant.ISAS[best]}"))
        for i, name in enumerate(quant.ISAS)]


@pytest.fixture(params=_isa_params())
def isa(request):
    """Runs the test on one int8 path, forced, then restores the automatic choice."""
    assert quant.set_isa(request.param) == request.param
    yield request.param
    quant.set_isa("auto")


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
    y = quant.gemm(x, blocks, qtype, k, b, activations="fp32")
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_matmul_close(y, x, w, b)
    if m < quant.LARGE_M:  # the register-blocked kernel itself (gemm would tile above LARGE_M)
        assert_matmul_close(quant.gemm_small_m(x, blocks, qtype, k, activations="fp32"), x, w)
    else:  # int8 runs its own kernel at every M (not the tiled path): held to its own reference
        assert_matmul_close(quant.gemm(x, blocks, qtype, k, b, activations="int8"), int8_rounded(x), w, b)


# ------------------------------------------------------------------------------ int8 activations


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 path sees it: q * d per block (the torch reference quantizer, float64)."""
    q, d, _ = quant.quantize_activations_torch(x)
    m, k = x.shape
    return (q.double().view(m, k // 32, 32) * d.double().unsqueeze(-1)).view(m, k)


def test_activation_quantizer_matches_its_torch_reference():
    torch.manual_seed(0)
    x = torch.randn(7, 192) * torch.rand(7, 1) * 10
    x[2, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
    x[3, :32] = torch.arange(32) - 15.5  # exact halves after scaling somewhere: rint, ties to even
    x[4, 64:96] = 1e-30  # tiny but nonzero
    q, d, s = quant.quantize_activations(x)
    qr, dr, sr = quant.quantize_activations_torch(x)
    assert torch.equal(q, qr) and torch.equal(d, dr) and torch.equal(s, sr)
    assert q.abs().max() == 127 and (q[2, 32:64] == 0).all() and d[2, 1] == 0 and s[2, 1] == 0
    # each element moves by at most half a step (plus the fp32 rounding of x / d)
    blocks_d = dr.double().repeat_interleave(32, dim=1)
    assert ((int8_rounded(x) - x.double()).abs() <= blocks_d * (0.5 + 1e-5)).all()


def _i8_cases():
    out = []
    for qtype in FORMATS:
        for m in (1, 3, 8, 37):  # 3, 37: not multiples of the 4-row register tile
            # N = 67, 75: tiles of 8 rows of W, then 3 rows one by one, in a last chunk of 3 or 11 rows
            out.append((qtype, m, 67 if m < 8 else 75, 224, m % 2 == 1))
    return out


@pytest.mark.parametrize("qtype,m,n,k,bias", _i8_cases())
def test_int8_path_is_exact_on_the_int8_rounded_input(qtype, m, n, k, bias, isa):
    """The integer dot products against float64 of dequant(W) times the int8-rounded x: equal up to
    fp32 summation (~1e-7 relative); the fp32 path misses this bound by ~1e-3, so it cannot pass."""
    torch.manual_seed(m * 7 + n)
    blocks = quant.quantize(torch.randn(n, k), qtype)
    w = quant.dequantize_torch(blocks, qtype, k)
    x = torch.randn(m, k) * torch.rand(m, 1) * 4
    b = torch.randn(n) if bias else None
    y = quant.gemm(x, blocks, qtype, k, b, activations="int8")
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_matmul_close(y, int8_rounded(x), w, b)
    assert_matmul_close(quant.gemm_small_m(x, blocks, qtype, k, activations="int8"), int8_rounded(x), w)


@pytest.mark.parametrize("qtype", FORMATS)
def test_int8_kernel_beyond_one_row_chunk(qtype, isa):
    """M = 70 (gemm itself would take the tiled path): the kernel's 64-row chunks of x, in turn."""
    torch.manual_seed(5)
    blocks = quant.quantize(torch.randn(24, 96), qtype)
    x = torch.randn(70, 96)
    y = quant.gemm_small_m(x, blocks, qtype, 96, activations="int8")
    w = quant.dequantize_torch(blocks, qtype, 96)
    assert_matmul_close(y, int8_rounded(x), w)
    out, b = torch.ones(70, 24), torch.randn(24)  # accumulate=1 onto the ones, with a bias
    assert quant._lib().ae_q_gemm_i8(quant.QTYPES[qtype][0], x.data_ptr(), 70, 96, blocks.data_ptr(), 24,
                                     b.data_ptr(), out.data_ptr(), 24, 1, 2) == 0
    assert_matmul_close(out - 1.0, int8_rounded(x), w, b)
    assert quant._lib().ae_q_gemm_i8(5, x.data_ptr(), 70, 96, blocks.data_ptr(), 24, None, out.data_ptr(),
                                     24, 0, 1) == -1  # an unknown type


@pytest.mark.parametrize("qtype", FORMATS)
def test_int8_path_against_the_fp32_product(qtype, isa):
    """Against x @ dequant(W)^T unrounded. Each x element moves by at most d / 2 = max|x_block| / 254,
    so |error| <= sum_blocks (max|x_block| / 254) * sum_block |w| (+ fp32 summation): a worst case,
    not a tuned rtol. Random rounding errors cancel, so on average the error is far inside it
    (~1/sqrt(K) of it); and it must be nonzero (the int8 path really ran)."""
    torch.manual_seed(1)
    m, n, k = 37, 67, 576
    blocks = quant.quantize(torch.randn(n, k), qtype)
    w = quant.dequantize_torch(blocks, qtype, k).double()
    x = torch.randn(m, k) * torch.rand(m, 1) * 4
    y = quant.gemm(x, blocks, qtype, k, activations="int8").double()
    ref = x.double() @ w.t()
    step = x.double().view(m, k // 32, 32).abs().amax(-1) / 254 * (1 + 1e-5)  # [m, blocks]
    w_abs = w.abs().view(n, k // 32, 32).sum(-1)  # [n, blocks]
    worst = step @ w_abs.t() + REL * (x.double().abs() @ w.abs().t()) + 1e-7
    err = (y - ref).abs()
    assert (err <= worst).all(), f"max error / worst case {(err / worst).max().item():.3g}"
    assert 0 < err.mean() < 0.25 * worst.mean()
    rel = (err.pow(2).mean() / ref.pow(2).mean()).sqrt().item()
    assert 1e-5 < rel < 2e-2, rel  # typically ~4e-3: 1/254 per element, averaged over K


@pytest.mark.parametrize("qtype", FORMATS)
def test_simd_paths_agree_bit_for_bit_and_rows_do_not_depend_on_the_batch(qtype):
    """AVX2 (maddubs + madd) and VNNI (vpdpbusd) sum the same exact int32 products in the same
    order, so they must agree to the bit; and on each path a row's result must not depend on the
    other rows of the batch (batch invariance: M = 1, 3, 37 and 300 give that row the same bits)."""
    torch.manual_seed(3)
    n, k = 75, 576
    blocks = quant.quantize(torch.randn(n, k), qtype)
    x = torch.randn(300, k) * 3
    simd = [name for name in quant.ISAS[1:quant.ISAS.index(quant.cpu_isa()) + 1]]
    if not simd:
        pytest.skip(f"this CPU runs only the portable C path ({quant.cpu_isa()})")
    results = []
    try:
        for name in simd:
            quant.set_isa(name)
            full = quant.gemm(x, blocks, qtype, k, activations="int8")
            for m in (1, 3, 37):
                assert torch.equal(quant.gemm(x[:m], blocks, qtype, k, activations="int8"), full[:m]), (name, m)
            results.append(full)
    finally:
        quant.set_isa("auto")
    for other in results[1:]:
        assert torch.equal(other, results[0])


def test_isa_choice(monkeypatch):
    """The automatic choice is the best this CPU can execute; forcing a path it cannot execute, or
    an unknown name, is refused with the reason, through the API and the environment."""
    best = quant.cpu_isa()
    assert quant.isa() == best and best in quant.ISAS
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    if best == "avx512_vnni":
        assert {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(flags)
    if best != "scalar":
        assert {"avx2", "fma", "f16c"} <= set(flags)
    try:
        assert quant.set_isa("scalar") == "scalar" and quant.isa() == "scalar"
        with pytest.raises(ValueError, match="unknown ISA 'sse9'"):
            quant.set_isa("sse9")
        assert quant.isa() == "scalar"  # a refused choice changes nothing
        if best != "avx512_vnni":
            with pytest.raises(ValueError, match="cannot execute avx512_vnni"):
                quant.set_isa("avx512_vnni")
        monkeypatch.setenv("ASYNCENGINE_CPU_ISA", "sse9")
        with pytest.raises(ValueError, match="ASYNCENGINE_CPU_ISA='sse9'"):
            quant._apply_isa_env(quant._lib())
        monkeypatch.setenv("ASYNCENGINE_CPU_ISA", "avx2" if best != "scalar" else "scalar")
        quant._apply_isa_env(quant._lib())
        assert quant.isa() == ("avx2" if best != "scalar" else "scalar")
    finally:
        assert quant.set_isa("auto") == best


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
def fp32_activations(monkeypatch):
    """The seam tests below pin the exact path (whatever ASYNCENGINE_QUANT_ACTIVATIONS says)."""
    monkeypatch.setattr(quant, "ACTIVATIONS", "fp32")


def test_the_switch(monkeypatch):
    monkeypatch.setenv("ASYNCENGINE_QUANT_ACTIVATIONS", " FP32 ")
    assert quant._activations_from_env() == "fp32"
    monkeypatch.setenv("ASYNCENGINE_QUANT_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="ASYNCENGINE_QUANT_ACTIVATIONS='int4': expected one of int8, fp32"):
        quant._activations_from_env()
    monkeypatch.delenv("ASYNCENGINE_QUANT_ACTIVATIONS")
    assert quant._activations_from_env() == "int8"  # the default (why: kernels/cpu/quant.py)
    blocks = quant.quantize(torch.randn(9, 64), "Q4_1")
    with pytest.raises(ValueError, match="activations='bf16'"):
        quant.gemm(torch.randn(2, 64), blocks, "Q4_1", 64, activations="bf16")
    # Linear (the model's seam) follows the module's setting
    layer = Linear(64, 9)
    layer.quantize_as("Q4_1")
    layer.load(QuantizedTensor("Q4_1", (9, 64), blocks))
    x, w = torch.randn(3, 64), quant.dequantize_torch(blocks, "Q4_1", 64)
    monkeypatch.setattr(quant, "ACTIVATIONS", "int8")
    assert_matmul_close(layer(x), int8_rounded(x), w)
    monkeypatch.setattr(quant, "ACTIVATIONS", "fp32")
    assert_matmul_close(layer(x), x, w)


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
    """quant.c built without -march (no AVX2 macros: the scalar loops) agrees with the reference,
    both activation paths and the activation quantizer (bit for bit)."""
    so = tmp_path / "quant_scalar.so"
    srcs = [str(build.SOURCE_DIR / f) for f in ("quant.c", "quant_i8.c", "quant_x8.c", "isa.c", "runtime.c")]
    subprocess.run(["cc", "-O2", "-fopenmp", "-fPIC", "-shared", "-std=c11", *srcs, "-o", str(so), "-lm"],
                   check=True, timeout=120)
    lib = ctypes.CDLL(str(so))
    assert lib.ae_simd_level() == 0
    assert lib.ae_q_set_isa(0) == 0  # the int8 kernel's portable C copy (its SIMD copies are tested above)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ae_q_gemm.argtypes = [ctypes.c_int, p, i64, i64, p, i64, p, p, i64, ctypes.c_int, ctypes.c_int]
    lib.ae_q_gemm_i8.argtypes = lib.ae_q_gemm.argtypes
    lib.ae_q_quantize_act.argtypes = [p, i64, i64, p, p, p]
    for qtype in FORMATS:
        blocks = quant.quantize(torch.randn(21, 128), qtype)
        x, b = torch.randn(6, 128), torch.randn(21)
        out = torch.full((6, 21), 1.0)
        rc = lib.ae_q_gemm(quant.QTYPES[qtype][0], x.data_ptr(), 6, 128, blocks.data_ptr(), 21, b.data_ptr(),
                           out.data_ptr(), 21, 1, 2)  # accumulate onto the ones
        assert rc == 0
        assert_matmul_close(out - 1.0, x, quant.dequantize_torch(blocks, qtype, 128), b)
        out = torch.full((6, 21), 1.0)
        assert lib.ae_q_gemm_i8(quant.QTYPES[qtype][0], x.data_ptr(), 6, 128, blocks.data_ptr(), 21, b.data_ptr(),
                                out.data_ptr(), 21, 1, 2) == 0
        assert_matmul_close(out - 1.0, int8_rounded(x), quant.dequantize_torch(blocks, qtype, 128), b)
    q, d, s = (torch.empty(6, 128, dtype=torch.int8), torch.empty(6, 4), torch.empty(6, 4))
    x = torch.randn(6, 128) * 3
    assert lib.ae_q_quantize_act(x.data_ptr(), 6, 128, q.data_ptr(), d.data_ptr(), s.data_ptr()) == 0
    qr, dr, sr = quant.quantize_activations_torch(x)
    assert torch.equal(q, qr) and torch.equal(d, dr) and torch.equal(s, sr)


# ----------------------------------------------------------------------------------- the seam


def test_linear_converts_between_dense_and_blocks(fp32_activations):
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


def test_vocab_embedding_pads_a_short_slice_and_is_the_tied_head(fp32_activations):
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
