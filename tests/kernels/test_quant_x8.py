"""The x8 layout of block-quantized weights (kernels/cpu/quant_common.h, quant_x8.c, quant_x8.h):
rows repacked 8 at a time, in place, for the int8 kernel.

What must hold: the C repacking equals its torch reference (``quant.x8_torch``) and is undone
exactly; every kernel gives the same bits on either layout (the int8 GEMM at every ISA, the fp32
GEMM, dequantize, the embedding gather); the int8 copies (portable C, AVX2, AVX512-VNNI) agree to the
bit with each other on both layouts, and a row's result does not depend on the batch (M); a
:class:`Linear` takes the layout of its activation mode and keeps its results."""
from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.cpu import build, quant, repack
from asyncengine.layers.linear import Linear, QuantizedTensor, VocabEmbedding

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


@pytest.fixture(autouse=True)
def _kernels_on():
    assert quant.kernels_available(), f"the C kernels did not build: {build.build_error()}"


needs_simd = pytest.mark.skipif(quant.cpu_isa() in (None, "scalar"), reason="weights are repacked only where a "
                                "SIMD copy of the x8 kernel runs (this CPU runs the portable C one)")


def _runnable_isas() -> list[str]:
    return list(quant.ISAS[:quant.ISAS.index(quant.cpu_isa()) + 1])


def _packed(blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    p = blocks.clone()
    repack.pack(p, qtype, k)
    return p


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("n,k", [(8, 32), (64, 96), (960, 576), (24, 1536)])
def test_repack_matches_the_torch_reference_and_round_trips(qtype, n, k):
    blocks = quant.quantize(torch.randn(n, k), qtype)
    ref = quant.x8_torch(blocks, qtype, k)
    assert not torch.equal(ref, blocks)  # it does move bytes
    assert torch.equal(quant.x8_torch(ref, qtype, k, inverse=True), blocks)
    p = _packed(blocks, qtype, k)
    assert torch.equal(p, ref)
    repack.unpack(p, qtype, k)
    assert torch.equal(p, blocks)


def test_repack_refuses_partial_groups():
    blocks = quant.quantize(torch.randn(12, 64), "Q4_1")
    with pytest.raises(MemoryError, match="multiple of 8"):
        repack.pack(blocks, "Q4_1", 64)
    assert not repack.can_pack(12) and repack.can_pack(16) == (quant.cpu_isa() != "scalar")


@pytest.mark.parametrize("qtype", FORMATS)
def test_every_kernel_gives_the_same_bits_on_either_layout(qtype):
    """int8 at every ISA this CPU runs (scalar included: all copies equal each other too), fp32 at
    small M and on the tiled large-M path, dequantize and the embedding gather."""
    torch.manual_seed(1)
    n, k = 96, 576
    blocks = quant.quantize(torch.randn(n, k), qtype)
    p = _packed(blocks, qtype, k)
    bias = torch.randn(n)
    x = torch.randn(70, k) * 3
    first = None
    try:
        for name in _runnable_isas():
            quant.set_isa(name)
            full = quant.gemm(x, blocks, qtype, k, bias, activations="int8")
            assert torch.equal(quant.gemm(x, p, qtype, k, bias, activations="int8", packed=True), full), name
            for m in (1, 2, 3, 4, 5, 33):  # register tiles 1-4, the stack-accumulator tile, batch invariance
                y = quant.gemm(x[:m], p, qtype, k, bias, activations="int8", packed=True)
                assert torch.equal(y, full[:m]), (name, m)
            first = full if first is None else first
            assert torch.equal(full, first), f"{name} differs from {_runnable_isas()[0]}"
    finally:
        quant.set_isa("auto")
    for m in (1, 4, 7, quant.LARGE_M + 3):
        assert torch.equal(quant.gemm(x[:m], p, qtype, k, bias, activations="fp32", packed=True),
                           quant.gemm(x[:m], blocks, qtype, k, bias, activations="fp32")), m
    assert torch.equal(quant.dequantize(p, qtype, k, packed=True), quant.dequantize(blocks, qtype, k))
    ids = torch.tensor([0, 7, 8, 95, 42])
    assert torch.equal(quant.embedding(ids, p, qtype, k, packed=True), quant.embedding(ids, blocks, qtype, k))


def test_torch_fallbacks_read_the_packed_layout(monkeypatch):
    blocks = quant.quantize(torch.randn(16, 64), "Q4_1")
    p = _packed(blocks, "Q4_1", 64)
    x = torch.randn(3, 64)
    want = quant.gemm_torch(x, blocks, "Q4_1", 64)
    monkeypatch.setattr(quant, "_lib", lambda: None)  # quant.gemm & co: the torch fallbacks
    assert torch.equal(quant.gemm(x, p, "Q4_1", 64, packed=True), want)
    assert torch.equal(quant.dequantize(p, "Q4_1", 64, packed=True), quant.dequantize_torch(blocks, "Q4_1", 64))
    assert torch.equal(quant.embedding(torch.tensor([5]), p, "Q4_1", 64, packed=True),
                       quant.dequantize_torch(blocks, "Q4_1", 64)[[5]])


@needs_simd
def test_linear_takes_the_layout_of_its_activation_mode(monkeypatch):
    monkeypatch.delenv("ASYNCENGINE_QUANT_LAYOUT", raising=False)
    blocks = quant.quantize(torch.randn(24, 96), "Q4_1")
    layer = Linear(96, 24)
    layer.quantize_as("Q4_1")
    layer.load(QuantizedTensor("Q4_1", (24, 96), blocks))
    x = torch.randn(3, 96)
    want8 = quant.gemm(x, blocks, "Q4_1", 96, activations="int8")
    want32 = quant.gemm(x, blocks, "Q4_1", 96, activations="fp32")
    layer.set_activations("int8")
    assert layer.packed and torch.equal(layer.qweight, quant.x8_torch(blocks, "Q4_1", 96))
    assert torch.equal(layer(x), want8) and "x8" in repr(layer)
    layer.load(QuantizedTensor("Q4_1", (24, 96), blocks))  # loading again: unpacked, copied, packed
    assert layer.packed and torch.equal(layer(x), want8)
    layer.set_activations("fp32")
    assert not layer.packed and torch.equal(layer.qweight, blocks) and torch.equal(layer(x), want32)
    monkeypatch.setenv("ASYNCENGINE_QUANT_LAYOUT", "rows")  # the switch: int8 on the file's rows
    layer.set_activations("int8")
    assert not layer.packed and torch.equal(layer(x), want8)
    monkeypatch.setenv("ASYNCENGINE_QUANT_LAYOUT", "x9")
    with pytest.raises(ValueError, match="ASYNCENGINE_QUANT_LAYOUT='x9'"):
        repack.layout_from_env()


@needs_simd
def test_a_partial_group_stays_in_rows_and_the_tied_head_gathers_from_x8():
    layer = Linear(64, 12)
    layer.quantize_as("Q8_0")
    layer.load(torch.randn(12, 64))
    layer.set_activations("int8")
    assert not layer.packed  # 12 rows: not whole groups of 8
    emb = VocabEmbedding(16, 64)
    emb.quantize_as("Q8_0")
    emb.load(torch.randn(16, 64))
    ids, h = torch.tensor([3, 15, 0]), torch.randn(2, 64)
    rows_emb, rows_logits = emb(ids), quant.gemm(h, emb.qweight, "Q8_0", 64, activations="int8")
    emb.set_activations("int8")
    assert emb.packed
    assert torch.equal(emb(ids), rows_emb) and torch.equal(emb.logits(h), rows_logits)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_row_ranges_on_prepared_activations_equal_the_whole_gemm(qtype, packed):
    """ae_q_prepare_act + ae_q_rows_q8 (kernels/cpu/moe.c shares a GEMM's 64-row items out over
    its own threads): any split of the rows at multiples of 8 gives the whole GEMM's bits."""
    import ctypes

    lib = build.load()
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ae_q_prepare_act.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, ptr]
    lib.ae_q_rows_q8.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, ptr, i64, i64, i64, ptr, i64]
    n, k, m = 200, 96, 5
    w = quant.quantize(torch.randn(n, k), qtype)
    if packed:
        repack.pack(w, qtype, k)
    x = torch.randn(m, k)
    whole = quant.gemm(x, w, qtype, k, activations="int8", packed=packed)
    t = quant.type_id(qtype, packed)
    q = torch.empty(m, k, dtype=torch.int8)
    d, s = torch.empty(m, k // 32), torch.empty(m, k // 32)
    xsum = torch.empty(m, k // 32, dtype=torch.int32)
    assert lib.ae_q_prepare_act(t, x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr(), xsum.data_ptr()) == 0
    out = torch.full((m, n), float("nan"))
    for n0, n1 in ((0, 64), (64, 72), (72, 200)):
        assert lib.ae_q_rows_q8(t, q.data_ptr(), d.data_ptr(), s.data_ptr(), xsum.data_ptr(), m, k, w.data_ptr(), n,
                                n0, n1, out.data_ptr(), n) == 0
    assert torch.equal(out, whole)
    assert lib.ae_q_rows_q8(t, q.data_ptr(), d.data_ptr(), s.data_ptr(), xsum.data_ptr(), m, k, w.data_ptr(), n,
                            0, n + 8, out.data_ptr(), n) == -1  # past the weight's rows: refused
