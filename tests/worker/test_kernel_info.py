"""dtype="auto" follows the kernels that run the weights (block-quantized weights on CPU: float32,
whatever the GEMM probe prefers), and the one-line description the CLI prints says the dtype, why,
and which kernels run."""
from __future__ import annotations

import pytest
import torch

import asyncengine.config.device as config_module
from asyncengine.config import EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.kernels.cpu import quant
from asyncengine.worker.kernel_info import describe


@pytest.fixture
def probe_says_bf16(monkeypatch):
    """A machine whose dense GEMM probe prefers bfloat16 (the AMX Xeon of issue 22)."""
    monkeypatch.setattr(config_module, "cpu_auto_dtype", lambda: torch.bfloat16)


@pytest.mark.parametrize("model,quantization,expected,why", [
    ("smollm2-135m-instruct", None, torch.float32, "block-quantized"),
    (None, None, torch.float32, "block-quantized"),  # None is the default model, a GGUF
    ("/models/x.GGUF", None, torch.float32, "block-quantized"),
    ("/models/x.gguf", "none", torch.bfloat16, "fastest GEMM"),  # dequantized at load: dense
    ("/models/hf-folder", None, torch.bfloat16, "fastest GEMM"),
    ("/models/hf-folder", "int4", torch.float32, "block-quantized"),
])
def test_auto_dtype_follows_the_weights(model, quantization, expected, why, probe_says_bf16):
    c = EngineConfig(model=model, quantization=quantization, device="cpu")
    assert c.torch_dtype == expected
    assert why in c.dtype_reason


def test_an_explicit_dtype_wins(probe_says_bf16):
    c = EngineConfig(model="/models/x.gguf", dtype="bfloat16", device="cpu")
    assert c.torch_dtype == torch.bfloat16 and c.dtype_reason == "asked for"


def test_quantized_activations_is_checked():
    with pytest.raises(ConfigError, match="quantized_activations must be 'auto', 'int8' or 'fp32', got 'int4'"):
        EngineConfig(quantized_activations="int4")


def test_the_description_names_dtype_activations_isa_and_attention(monkeypatch):
    c = EngineConfig(model="/models/x.gguf", device="cpu", quantized_activations="int8", attention_backend="cpu")
    line = describe(c)
    assert line.startswith("float32 (auto: block-quantized")
    assert f"int8 activations x quantized weights on {quant.isa()}" in line and line.endswith("cpu attention")
    c = EngineConfig(model="/models/x.gguf", device="cpu", quantized_activations="fp32", attention_backend="torch")
    assert "fp32 activations x quantized weights" in describe(c) and "torch attention" in describe(c)
    monkeypatch.setattr(quant, "ACTIVATIONS", "int8")  # auto: the process default
    assert "int8 activations" in describe(EngineConfig(model="/models/x.gguf", device="cpu"))
    dense = EngineConfig(model="/models/hf", device="cpu", dtype="float32", attention_backend="cpu")
    assert describe(dense) == "float32 (asked for); cpu attention"
    # the backend the workers built, where auto fell back for the model (a Gemma on CUDA: torch)
    assert describe(dense, attention="torch") == "float32 (asked for); torch attention"



def test_the_description_names_the_transformers_backend():
    dense = EngineConfig(model="/models/hf", device="cpu", dtype="float32", attention_backend="cpu")
    assert describe(dense, via_transformers=True) == ("float32 (asked for); cpu attention; model code from "
                                                      "transformers (Transformers backend; no native decode step)")
