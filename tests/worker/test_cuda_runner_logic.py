"""The CUDA runner's plain logic, pinned on CPU: capture sizes and decode-batch padding, the
persistent input buffers, the KV-cache memory budget, the device choice (CUDA faked)."""
from __future__ import annotations

import pytest
import torch

from asyncengine.config import EngineConfig, resolve_device, resolve_dtype
from asyncengine.errors import ConfigError
from asyncengine.attention.buffers import PersistentBuffers
from asyncengine.worker.cuda_utils import (capture_sizes, kv_cache_budget, padded_batch_size,
                                           to_host_list)


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(1000, limit=64)[-1] == 64


def test_padded_batch_size():
    sizes = capture_sizes(40)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 40)] == [1, 2, 4, 4, 8, 8, 16, 24, 40]
    assert padded_batch_size(41, sizes) is None  # larger than any graph: eager
    for n in range(1, 41):  # always the smallest captured size that holds the batch
        p = padded_batch_size(n, sizes)
        assert p >= n and not any(n <= s < p for s in sizes)
    with pytest.raises(ValueError):
        padded_batch_size(0, sizes)


def test_persistent_buffers_reuse_and_pad():
    b = PersistentBuffers({"ids": ((8,), torch.int64), "bt": ((4, 3), torch.int32)}, torch.device("cpu"))
    v1 = b.stage("ids", [5, 6, 7])
    assert v1.tolist() == [5, 6, 7]
    ptr = v1.data_ptr()
    v2 = b.stage("ids", [1, 2], n=5, fill=-1)
    assert v2.tolist() == [1, 2, -1, -1, -1] and v2.data_ptr() == ptr  # same memory every step
    t = b.stage_rows("bt", [[4], [1, 2, 3]], n=3)
    assert t.tolist() == [[4, 0, 0], [1, 2, 3], [0, 0, 0]]
    t = b.stage_rows("bt", [[9, 9]])  # stale entries of earlier steps are cleared
    assert t.tolist() == [[9, 9, 0]]
    with pytest.raises(ValueError):
        b.stage("ids", list(range(9)))
    with pytest.raises(ValueError):
        b.stage_rows("bt", [[1, 2, 3, 4]])


def test_kv_cache_budget():
    gib = 1 << 30
    assert kv_cache_budget(80 * gib, 0.9, 20 * gib) == 52 * gib
    assert kv_cache_budget(10 * gib, 1.0, 0) == 10 * gib
    with pytest.raises(ConfigError, match="no memory left"):
        kv_cache_budget(10 * gib, 0.5, 6 * gib)
    with pytest.raises(ConfigError):
        kv_cache_budget(10 * gib, 0.0, 0)


def test_to_host_list_cpu():
    assert to_host_list(torch.tensor([3, 1, 2])) == [3, 1, 2]


def test_device_auto(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr("asyncengine.kernels.triton_available", lambda: True)
    cfg = EngineConfig(device="auto")
    assert cfg.torch_device.type == "cuda" and cfg.attention_backend_name == "triton"


def test_kv_blocks_from_the_profiled_budget():
    """The core sizes the cache from the CUDA budget when a rank measured one (not the CPU default,
    not capped by the memory-fraction rule), still bounded by what max_num_seqs full requests use."""
    from asyncengine.contracts.kv_cache_spec import KVCacheSpec
    from asyncengine.engine_core.core import num_kv_blocks_for

    cfg = EngineConfig(device="cpu", max_num_seqs=4, block_size=16)
    spec = KVCacheSpec(block_size=16, bytes_per_block=1 << 20, available_bytes=100 << 20, kv_budget_bytes=50 << 20)
    assert num_kv_blocks_for(cfg, spec, max_model_len=4096) == 50
    assert num_kv_blocks_for(cfg, spec, max_model_len=64) == 4 * 4 + 1
    cpu = KVCacheSpec(block_size=16, bytes_per_block=1 << 20, available_bytes=100 << 20)
    # no profiled budget (CPU): capped at kv_cache_memory_fraction of the memory available
    assert num_kv_blocks_for(cfg, cpu, max_model_len=4096) == int(cfg.kv_cache_memory_fraction * 100)
    assert num_kv_blocks_for(EngineConfig(device="cpu", kv_cache_bytes=10 << 20), spec, 4096) == 10


def test_rms_norm_residual_form_is_the_unfused_sum():
    """RMSNorm(x, residual=r) == (norm(x + r), x + r) bit for bit (the decoder layer relies on it)."""
    from asyncengine.layers.norm import RMSNorm

    torch.manual_seed(0)
    n = RMSNorm(32)
    with torch.no_grad():
        n.weight.normal_()
    x, r = torch.randn(5, 32), torch.randn(5, 32)
    h, s = n(x, residual=r)
    assert torch.equal(s, r + x) and torch.equal(h, n(r + x))
