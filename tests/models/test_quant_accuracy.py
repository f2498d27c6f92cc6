"""Quantized weights on the real default model (SmolLM2-135M-Instruct Q4_1, token_embd/LM head
Q8_0): over >= 1,000 tokens of this repository's docs, teacher-forced, the blocks run by the CPU
kernels against the same weights dequantized to fp32 (quantization="none"). Issue 11's bar: top-1
agreement >= 99% and mean KL <= 0.01; with fp32 activations the kernels keep the block math exact,
so we see ~1e-11. With int8 activations (opt-in) the same run measures top-1 95-96%, mean KL 3.6e-3:
that misses the top-1 bar, which is why fp32 stays the default; its test pins what int8 does hold."""
from __future__ import annotations

import importlib.util
import os

import pytest

from asyncengine.kernels.cpu import quant
from asyncengine.models.default_model import ensure_default_model

pytestmark = pytest.mark.smollm2


def _bench():
    spec = importlib.util.spec_from_file_location(
        "quant_accuracy", os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "quant_accuracy.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_quantized_default_model_matches_dequantized_on_repo_text(monkeypatch):
    monkeypatch.setattr(quant, "ACTIVATIONS", "fp32")
    res = _bench().measure(ensure_default_model(), None, tokens=1024, chunk=32)  # 32 < LARGE_M: the kernel path
    print(res)
    assert res["tokens"] >= 1000 and res["formats"] == ["Q4_1", "Q8_0"]
    assert res["top1_agreement"] >= 0.99
    assert res["mean_kl"] <= 0.01


def test_int8_activations_on_the_default_model(monkeypatch):
    """int8 activations, same text and chunks. Issue 11's KL bar holds (measured 3.6e-3 <= 0.01) and
    perplexity moves by 0.2-0.8%; top-1 agreement is 95.0-95.8%, below the 99% bar (a 135M model's
    many near-ties flip under the ~1/254 rounding of every projection's input: each projection alone
    costs 0.5-2.6 points, docs/quantization.md). The two figures are two kernel versions that differ
    only in fp32 summation order: an upstream change of 1e-7 flips some rint() by a whole int8 step,
    so the agreement moves by about a point. We pin the measured level with that much room (0.93,
    ppl within 2%), so a real regression in the int8 math fails here. Its perplexity on real text is
    within 1% of llama.cpp's on the same GGUF (benchmarks/perplexity.py, docs/cpu_decode.md); why it
    is opt-in all the same: kernels/cpu/quant.py."""
    monkeypatch.setattr(quant, "ACTIVATIONS", "int8")
    res = _bench().measure(ensure_default_model(), None, tokens=1024, chunk=32)
    print(res)
    assert res["tokens"] >= 1000 and res["formats"] == ["Q4_1", "Q8_0"]
    assert res["mean_kl"] <= 0.01
    assert res["top1_agreement"] >= 0.93
    assert abs(res["ppl_quantized"] / res["ppl_reference"] - 1) <= 0.02
    assert res["mean_kl"] > 1e-6  # the int8 path really ran (fp32 activations give ~1e-11)
