"""reshape_and_cache (Triton) vs reshape_and_cache_ref (torch) vs an explicit per-slot loop."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from asyncengine.kernels import reshape_and_cache, reshape_and_cache_ref

ON_INTERPRETER = not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


def make_inputs(num_tokens, num_kv_heads, head_dim, num_blocks, block_size, *, dtype=torch.float32,
                cache_dtype=None, pad_slots=0, strided=False, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    if strided:  # key/value as slices of a fused QKV projection output
        qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=g).to(dtype)
        key = qkv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
        value = qkv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    else:
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
        value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(cache_dtype or dtype)  # pre-existing content must survive
    v_cache = torch.randn(shape, generator=g).to(cache_dtype or dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]  # unique, scattered over blocks
    if pad_slots:
        slots[torch.randperm(num_tokens, generator=g)[:pad_slots]] = -1
    return [t.to(device) for t in (key, value, k_cache, v_cache, slots)]


def test_reference_semantics():
    """Each slot s >= 0 gets key[t] at cache.view(-1, Hkv, D)[s]; every other slot is left as it was."""
    key, value, k_cache, v_cache, slots = make_inputs(10, 2, 8, 4, 16, pad_slots=3)
    k0, v0 = k_cache.clone(), v_cache.clone()
    reshape_and_cache_ref(key, value, k_cache, v_cache, slots)
    want_k, want_v = k0.view(-1, 2, 8).clone(), v0.view(-1, 2, 8).clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s], want_v[s] = key[t], value[t]
    assert torch.equal(k_cache.view(-1, 2, 8), want_k)
    assert torch.equal(v_cache.view(-1, 2, 8), want_v)


@pytest.mark.parametrize(
    "num_tokens,hkv,d,num_blocks,bs,dtype,cache_dtype,pad,strided",
    [
        (17, 2, 16, 4, 16, torch.float32, None, 0, False),
        (33, 4, 64, 6, 16, torch.float32, None, 5, True),  # padding slots + strided key/value
        (9, 3, 48, 3, 32, torch.float32, None, 2, False),  # non-pow2 heads and head_dim
        (12, 2, 32, 4, 16, torch.bfloat16, None, 1, True),
        (8, 1, 128, 2, 16, torch.float16, None, 0, False),
        (10, 2, 16, 2, 16, torch.float32, torch.bfloat16, 0, False),  # cast to the cache dtype
        (4, 16, 256, 1, 16, torch.bfloat16, None, 0, False),  # heads split over several programs
        (6, 2, 16, 3, 24, torch.float32, None, 1, False),  # non-pow2 block size
    ],
)
def test_kernel_matches_reference(device, num_tokens, hkv, d, num_blocks, bs, dtype, cache_dtype, pad, strided):
    key, value, k_cache, v_cache, slots = make_inputs(num_tokens, hkv, d, num_blocks, bs, dtype=dtype,
                                                      cache_dtype=cache_dtype, pad_slots=pad, strided=strided,
                                                      device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache_ref(key, value, k_ref, v_ref, slots)
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    if cache_dtype is None or not ON_INTERPRETER:
        assert torch.equal(k_cache, k_ref)
        assert torch.equal(v_cache, v_ref)
    else:  # triton's CPU interpreter truncates fp32 -> bf16 casts (the GPU rounds to nearest even): 1 ulp
        torch.testing.assert_close(k_cache, k_ref, atol=1e-6, rtol=2 ** -7)
        torch.testing.assert_close(v_cache, v_ref, atol=1e-6, rtol=2 ** -7)


def test_int32_slots_and_strided_cache_views(device):
    """int32 slot_mapping; caches that are views into one [2, ...] KV tensor (k = kv[0], v = kv[1])."""
    key, value, _, _, slots = make_inputs(11, 2, 16, 3, 16, pad_slots=2, device=device)
    kv = torch.zeros(2, 3, 16, 2, 16, device=device)
    kv_ref = kv.clone()
    reshape_and_cache(key, value, kv[0], kv[1], slots.to(torch.int32))
    reshape_and_cache_ref(key, value, kv_ref[0], kv_ref[1], slots)
    assert torch.equal(kv, kv_ref)


def test_empty_and_all_padding(device):
    key, value, k_cache, v_cache, slots = make_inputs(5, 2, 16, 2, 16, device=device)
    k0 = k_cache.clone()
    reshape_and_cache(key[:0], value[:0], k_cache, v_cache, slots[:0])
    reshape_and_cache(key, value, k_cache, v_cache, torch.full_like(slots, -1))
    assert torch.equal(k_cache, k0)


def test_shape_errors(device):
    key, value, k_cache, v_cache, slots = make_inputs(5, 2, 16, 2, 16, device=device)
    with pytest.raises(ValueError):
        reshape_and_cache(key, value, k_cache, v_cache, slots[:4])
    with pytest.raises(ValueError):
        reshape_and_cache(key[:, :1], value[:, :1], k_cache, v_cache, slots)


def test_compiles_for_cuda(compile_for_cuda):
    """The launch configuration compiles to a cubin (the interpreter never runs the compiler)."""
    rc_mod = importlib.import_module("asyncengine.kernels.reshape_and_cache")  # the module, not the function
    log = compile_for_cuda(rc_mod)
    key, value, k_cache, v_cache, slots = make_inputs(4, 8, 128, 2, 16, dtype=torch.bfloat16, strided=True)
    rc_mod.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert [name for name, _ in log] == ["_reshape_and_cache_kernel"]
