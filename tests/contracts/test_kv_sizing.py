"""The KV-cache sizing policy (core/kv_sizing.py) and the lazily touched cache memory."""
from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from asyncengine import EngineConfig, LLM, SamplingParams
from asyncengine.contracts.kv_sizing import KVModelShape, bytes_per_block, plan_kv_cache
from asyncengine.errors import ConfigError
from asyncengine.attention.kv_cache import kv_cache_zeros

SHAPE = KVModelShape(num_layers=30, num_kv_heads=3, head_dim=64, max_model_len=8192)  # SmolLM2-135M
PER_BLOCK = 2 * 30 * 16 * 3 * 64 * 4  # fp32, block_size 16


def cfg(**kw) -> tuple:
    """What the sizing reads of an engine config: its cache view, max_num_seqs and the cache's bytes
    per value (fp32 here)."""
    config = EngineConfig(dtype="float32", device="cpu", **kw)
    return config.cache_config, config.scheduler_config.max_num_seqs, config.torch_dtype.itemsize


def test_bytes_per_block():
    assert bytes_per_block(SHAPE, 16, 4) == PER_BLOCK
    assert bytes_per_block(SHAPE, 32, 2) == PER_BLOCK


def test_by_need_when_memory_allows():
    plan = plan_kv_cache(*cfg(max_num_seqs=4), SHAPE, available_bytes=64 << 30)
    assert plan.num_blocks == 4 * (8192 // 16) + 1
    assert plan.nbytes == plan.num_blocks * PER_BLOCK


def test_capped_at_a_fraction_of_available_memory():
    avail = 8 << 30
    plan = plan_kv_cache(*cfg(max_num_seqs=256, kv_cache_memory_fraction=0.25), SHAPE, available_bytes=avail)
    assert plan.num_blocks == (avail // 4) // PER_BLOCK
    assert plan.nbytes <= avail // 4
    half = plan_kv_cache(*cfg(max_num_seqs=256, kv_cache_memory_fraction=0.125), SHAPE, available_bytes=avail)
    assert half.num_blocks == (avail // 8) // PER_BLOCK


def test_explicit_sizes_win_over_need_and_memory():
    assert plan_kv_cache(*cfg(num_kv_blocks=7), SHAPE, available_bytes=1).num_blocks == 7
    assert plan_kv_cache(*cfg(kv_cache_bytes=10 * PER_BLOCK + 5), SHAPE, available_bytes=1).num_blocks == 10


def test_unknown_memory_means_need_alone():
    assert plan_kv_cache(*cfg(max_num_seqs=2), SHAPE, available_bytes=None).num_blocks == 2 * 512 + 1


def test_too_small_is_a_clear_error():
    with pytest.raises(ConfigError, match="fewer than 2 blocks"):
        plan_kv_cache(*cfg(kv_cache_bytes=PER_BLOCK), SHAPE, available_bytes=None)
    with pytest.raises(ConfigError, match="kv_cache_memory_fraction"):
        plan_kv_cache(*cfg(), SHAPE, available_bytes=PER_BLOCK)
    with pytest.raises(ConfigError, match="kv_cache_memory_fraction must be in"):
        cfg(kv_cache_memory_fraction=0)


# ------------------------------------------------------------------- the memory is touched lazily

_PAGE = mmap.PAGESIZE


def resident_pages(t: torch.Tensor) -> int:
    """Pages of ``t``'s memory that are resident (mincore), i.e. were ever touched."""
    libc = ctypes.CDLL(None, use_errno=True)
    addr, n = t.data_ptr(), t.numel() * t.element_size()
    start = addr // _PAGE * _PAGE
    length = addr + n - start
    pages = -(-length // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec)
    assert rc == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def test_kv_cache_zeros_is_zero_and_untouched():
    t = kv_cache_zeros((2, 1024, 16, 64), torch.float32, torch.device("cpu"))  # 8 MiB
    assert resident_pages(t) == 0
    t[0, 3].fill_(1.0)  # one block of one head: 4 KiB
    assert resident_pages(t) == 1
    assert float(t[1].abs().sum()) == 0.0 and float(t[0, 4:].abs().sum()) == 0.0


def test_engine_touches_only_the_blocks_it_uses(tiny_llama_dir):
    bs = 16
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_bytes=256 << 20, block_size=bs)
    from worker_hooks import runner_of

    [runner] = llm.engine.collective_rpc(runner_of)
    k0, v0 = runner.kv_caches[0]
    total_pages = -(-k0.numel() * k0.element_size() // _PAGE)
    assert all(resident_pages(t) == 0 for kv in runner.kv_caches for t in kv)
    prompt = list(range(3, 40))  # 37 tokens + 12 generated = 49 tokens: 4 blocks
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 12
    hk, d = k0.shape[0], k0.shape[-1]
    used_blocks = -(-(len(prompt) + 12) // bs)
    # per head, the used blocks are contiguous (a fresh pool hands out blocks in id order)
    bound = hk * (-(-used_blocks * bs * d * k0.element_size() // _PAGE) + 1)
    for kv in runner.kv_caches:
        for t in kv:
            r = resident_pages(t)
            assert 0 < r <= bound < total_pages // 100, (r, bound, total_pages)
