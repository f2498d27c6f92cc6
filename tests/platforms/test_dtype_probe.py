"""dtype="auto" on CPU picks by a measured GEMM probe (cached per machine), not by a CPU flag."""
from __future__ import annotations

import json

import torch

from asyncengine.platforms import dtype_probe


def test_probe_measures_both_types_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    result = dtype_probe.probe(use_cache=False)
    assert result["gflops"]["float32"] > 0 and result["dtype"] in ("float32", "bfloat16")
    cached = json.loads((tmp_path / "probe.json").read_text())
    assert cached[dtype_probe.machine_key()] == result

    calls = []
    monkeypatch.setattr(dtype_probe, "measure", lambda: calls.append(1) or {})
    assert dtype_probe.probe() == result and not calls  # the second start reads the file


def test_pick_follows_the_measured_rates(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    for fp32, bf16, want in ((100.0, 400.0, "bfloat16"),  # an EPYC with native bf16: 4x
                             (334.0, 168.0, "float32"),  # a Xeon whose bf16 flag promises more than it does
                             (100.0, 120.0, "float32"),  # not enough faster to give up fp32's precision
                             (57.0, 1.0, "float32")):  # AVX2 only: bf16 emulated
        rates = {torch.float32: fp32, torch.bfloat16: bf16}
        monkeypatch.setattr(dtype_probe, "gemm_gflops", lambda dt, *a, **k: rates[dt])
        assert dtype_probe.probe(use_cache=False)["dtype"] == want
        assert dtype_probe.fastest_cpu_dtype() == getattr(torch, want)


def test_a_corrupt_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    (tmp_path / "probe.json").write_text("{not json")
    assert dtype_probe.probe()["dtype"] in ("float32", "bfloat16")
    assert dtype_probe.machine_key() in json.loads((tmp_path / "probe.json").read_text())
