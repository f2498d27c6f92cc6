"""oneDNN's per-shape primitive caches bounded (asyncengine/platforms/onednn_caches.py): the two
capacities set unless the user set them, a value that would crash torch raised, and, in a fresh
process, the bound in effect: a cached primitive is evicted after more shapes than the capacity,
and malloc memory stops growing with the number of shapes (~0.55 MiB per cached primitive)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncengine.platforms.onednn_caches import CAPACITY, VARIABLES, bound_onednn_caches


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_sets_both_capacities_when_unset(clean_env):
    assert bound_onednn_caches() == {name: str(CAPACITY) for name in VARIABLES}
    assert all(os.environ[name] == str(CAPACITY) for name in VARIABLES)


def test_a_user_value_wins(clean_env):
    clean_env.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    got = bound_onednn_caches()
    assert got["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024" and got["LRU_CACHE_CAPACITY"] == str(CAPACITY)


def test_lru_zero_is_raised_to_one(clean_env):  # torch 2.13 segfaults at its first bf16 GEMM with 0
    clean_env.setenv("LRU_CACHE_CAPACITY", "0")
    clean_env.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")  # oneDNN's own: 0 is valid (no cache)
    assert bound_onednn_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "LRU_CACHE_CAPACITY": "1"}


_VALUES = st.one_of(st.text(max_size=8), st.integers(-5, 10**6).map(str),
                    st.from_regex(r"\s*[0-9]{1,4}\s*", fullmatch=True))


@given(_VALUES)
def test_any_value_ends_as_a_capacity_torch_can_run(value):
    saved = {name: os.environ.pop(name, None) for name in VARIABLES}
    try:
        os.environ["LRU_CACHE_CAPACITY"] = value.replace("\x00", "")
        got = bound_onednn_caches()
        lru = got["LRU_CACHE_CAPACITY"]
        assert lru.isascii() and lru.isdigit() and int(lru) >= 1
        assert got["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(CAPACITY)
    finally:
        for name, v in saved.items():
            os.environ.pop(name, None)
            if v is not None:
                os.environ[name] = v


# In a fresh process: the engine's call, then bf16 GEMMs of 2 x CAPACITY distinct row counts (each
# a new oneDNN primitive), then the first shape again. Bounded, it was evicted and is compiled again
# (oneDNN's verbose log: create:cache_miss); at torch's default of 1,024 it is a cache_hit.
_PROBE = r"""
import ctypes, json, os, sys
from asyncengine.platforms.onednn_caches import bound_onednn_caches
bound_onednn_caches(int(sys.argv[1]))
import torch
torch.set_num_threads(1)
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "a b c d e f g uord i j".split()]
libc = ctypes.CDLL(None); libc.mallinfo2.restype = MI
w = torch.randn(64, 64, dtype=torch.bfloat16); x = torch.randn(1024, 64, dtype=torch.bfloat16)
torch.nn.functional.linear(x[:2], w)  # one row is a GEMV, not oneDNN
used0 = libc.mallinfo2().uord
for m in range(3, 3 + int(sys.argv[2])):
    torch.nn.functional.linear(x[:m], w)
used1 = libc.mallinfo2().uord
ctypes.CDLL(None).fflush(None); print("MARK", flush=True)  # oneDNN logs via C stdio
torch.nn.functional.linear(x[:2], w)  # one row is a GEMV, not oneDNN
ctypes.CDLL(None).fflush(None)
print(json.dumps({"grew_mib": (used1 - used0) / 2**20}), flush=True)
"""


def _probe(capacity: int, shapes: int) -> tuple[list[str], list[str], dict]:
    env = {**os.environ, "ONEDNN_VERBOSE": "profile_create"}
    for name in VARIABLES:
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", _PROBE, str(capacity), str(shapes)], env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    cut = out.index("MARK")
    created = [ln for ln in out if ln.startswith("onednn_verbose") and ",create:" in ln]
    after = [ln for ln in out[cut:] if ln.startswith("onednn_verbose") and ",create:cache_miss," in ln]
    return created, after, json.loads(out[-1])


def test_bound_in_effect_in_a_fresh_process():
    created, after, mem = _probe(CAPACITY, 2 * CAPACITY)
    if not created:
        pytest.skip("bf16 GEMMs do not run through oneDNN on this CPU (no primitive created)")
    assert after, "the first shape was still cached after 2 x CAPACITY others: the bound is not in effect"
    # ~0.55 MiB per cached primitive (measured): bounded, the growth stays near CAPACITY of them,
    # not 2 x CAPACITY
    assert mem["grew_mib"] < 1.5 * CAPACITY * 0.55, mem


def test_without_the_bound_the_first_shape_stays_cached():  # the probe above can tell the difference
    created, after, mem = _probe(1024, 2 * CAPACITY)
    if not created:
        pytest.skip("bf16 GEMMs do not run through oneDNN on this CPU (no primitive created)")
    assert not after and mem["grew_mib"] > 1.5 * CAPACITY * 0.55, mem
