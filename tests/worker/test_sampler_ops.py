"""argmax_rows: the same index as torch.argmax (first maximum, NaN as maximum) for every shape,
dtype and tie pattern, including vocabularies that are not a multiple of the block."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from asyncengine.worker.sampler_ops import _BLOCK, argmax_rows


@settings(max_examples=60, deadline=None)
@given(B=st.integers(0, 5), V=st.integers(1, 3 * _BLOCK + 7),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       levels=st.integers(1, 6), seed=st.integers(0, 2**31 - 1), nan=st.booleans())
def test_argmax_rows_equals_torch_argmax(B, V, dtype, levels, seed, nan):
    g = torch.Generator().manual_seed(seed)
    # few distinct values: many ties, across blocks and in the tail
    x = torch.randint(0, levels, (B, V), generator=g).to(dtype)
    if nan and B and V > 1:
        x[0, int(torch.randint(0, V, (1,), generator=g))] = float("nan")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("V", [4 * _BLOCK, 4 * _BLOCK + 1, 32000])
def test_argmax_rows_ties_between_blocks_and_tail(V):
    x = torch.zeros(6, V)
    x[0, 5] = x[0, V - 1] = 1.0  # first block wins the tie with the tail
    x[1, V - 1] = 2.0  # the tail alone
    x[2, _BLOCK] = x[2, 3 * _BLOCK] = 3.0  # two blocks tie: the first
    x[3].fill_(-float("inf"))  # all -inf: index 0
    x[4, V - 1] = float("nan")  # NaN in the tail beats every number
    x[5, 7] = float("nan")
    x[5, V - 1] = float("nan")  # two NaNs: the first
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    # a padded vocabulary: a column slice (rows not contiguous) and the bf16 logits of a model
    wide = torch.randn(3, V + 64)
    assert torch.equal(argmax_rows(wide[:, :V]), wide[:, :V].argmax(dim=-1))
    xb = torch.randn(3, V).bfloat16()
    assert torch.equal(argmax_rows(xb), xb.float().argmax(dim=-1))
