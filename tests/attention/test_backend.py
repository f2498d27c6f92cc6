"""The backend seam's soft-capping contract (Gemma 2): torch and cpu (in its C kernel) cap, a
backend without it refuses at start with a ConfigError; and both paths' capped, windowed attention
equals a dense reference."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncengine.attention.backend import SeqChunk, StepBatch
from asyncengine.attention.cpu_backend import CpuBackend
from asyncengine.attention.selector import get_model_backend, model_backend_name
from asyncengine.attention.torch_backend import TorchBackend
from asyncengine.errors import ConfigError

PLAIN = SimpleNamespace(attn_softcap=None, layer_windows=[None, None])
GEMMA2 = SimpleNamespace(attn_softcap=50.0, layer_windows=[4, None])
WINDOWED = SimpleNamespace(attn_softcap=None, layer_windows=[4, None])
SHAPES = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=16, dtype=torch.float32,
              device=torch.device("cpu"))


def test_cpu_keeps_its_kernel_for_softcap():
    b = get_model_backend("cpu", GEMMA2, **SHAPES)
    assert isinstance(b, CpuBackend) and b.kernels and b.supports_batch_invariant  # no fallback to the torch path
    meta = b.build_metadata(StepBatch([SeqChunk(0, 3, 0, [0])], [0, 1, 2]))
    assert meta.backend is b


@pytest.mark.parametrize("args,what", [(GEMMA2, "soft-capping"), (WINDOWED, "sliding-window")])
def test_a_backend_without_what_the_model_needs_refuses_before_it_is_built(args, what):
    with pytest.raises(ConfigError, match=what):
        get_model_backend("triton", args, **SHAPES)  # on CPU: refused before triton's CUDA-only init


@pytest.mark.parametrize("args,want", [(PLAIN, "triton"), (GEMMA2, "torch"), (WINDOWED, "torch")])
def test_auto_picks_a_backend_that_runs_the_model(args, want):
    """auto resolved to triton on a GPU falls back to torch for a Gemma (found on an H200: auto
    refused every Gemma); a backend the user named is kept, to be refused with the reason."""
    assert model_backend_name("auto", "triton", args) == want
    assert model_backend_name("triton", "triton", args) == "triton"
    assert model_backend_name("auto", "cpu", args) == "cpu"


@pytest.mark.parametrize("cls,long_prefill", [(TorchBackend, False), (CpuBackend, False), (CpuBackend, True)])
@pytest.mark.parametrize("window", [None, 5])
def test_softcap_and_window_match_dense(window, cls, long_prefill, monkeypatch):
    """The cpu backend caps in C, and in the torch path for chunks past its kernel's query length."""
    if long_prefill:
        monkeypatch.setattr("asyncengine.attention.cpu_backend.KERNEL_MAX_QUERY_LEN", 4)
    torch.manual_seed(0)
    b = cls(**SHAPES)
    n, cap = 11, 2.0
    q, k, v = torch.randn(n, 4, 16) * 3, torch.randn(n, 2, 16), torch.randn(n, 2, 16)
    caches = b.allocate_kv_caches(1)[0]
    meta = b.build_metadata(StepBatch([SeqChunk(0, n, 0, [0, 1, 2])], list(range(n))))
    if cls is CpuBackend:
        assert b.kernels and len(meta.prefills) == int(long_prefill)  # C kernel, or the torch prefill path
    out = b.forward(q, k, v, caches, meta, window, softcap=cap).view(n, 4, 16)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * b.scale
    s = torch.tanh(s / cap) * cap
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (j <= i) & ((j > i - window) if window else True)
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~allowed, float("-inf")), -1), vv)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
