"""rms_norm (Triton) vs rms_norm_ref (torch) vs the HF Llama formulation."""

from __future__ import annotations

import importlib

import pytest
import torch

from asyncengine.kernels import rms_norm, rms_norm_ref


def hf_llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, verbatim numerics."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_hf(dtype):
    x = torch.randn(3, 5, 48).to(dtype)
    w = torch.randn(48).to(dtype)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6), hf_llama_rms_norm(x, w, 1e-6), atol=0, rtol=0)


@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference(device, hidden, dtype):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=g).to(dtype).to(device)
    w = torch.randn(hidden, generator=g).to(dtype).to(device)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual(device, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, generator=g).to(dtype).to(device)
    r = torch.randn(2, 3, 64, generator=g).to(dtype).to(device)
    w = torch.randn(64, generator=g).to(dtype).to(device)
    x0, r0 = x.clone(), r.clone()
    out, res = rms_norm(x, w, 1e-6, residual=r)
    out_ref, res_ref = rms_norm_ref(x, w, 1e-6, residual=r)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    # The sum is rounded to dtype once; exact in fp32. (bf16: triton's CPU interpreter truncates the
    # fp32 -> bf16 cast where the GPU rounds to nearest even, so allow 1 ulp.)
    torch.testing.assert_close(res, res_ref, **(dict(atol=0, rtol=0) if dtype == torch.float32 else tol))
    torch.testing.assert_close(out, out_ref, **tol)
    assert out.shape == x.shape and res.shape == x.shape
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must not be modified"


def test_strided_rows(device):
    base = torch.randn(6, 80, device=device)
    x = base[:, 8:72]  # row stride 80, last dim contiguous
    w = torch.randn(64, device=device)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=1e-5, rtol=1e-5)


def test_compiles_for_cuda(compile_for_cuda):
    """The launch configuration compiles to a cubin (the interpreter never runs the compiler)."""
    rn_mod = importlib.import_module("asyncengine.kernels.rms_norm")  # the module, not the function
    log = compile_for_cuda(rn_mod)
    x = torch.randn(4, 2048, dtype=torch.bfloat16)
    rn_mod.rms_norm(x, torch.ones(2048, dtype=torch.bfloat16), 1e-6, residual=x)
    assert [name for name, _ in log] == ["_rms_norm_kernel"]
