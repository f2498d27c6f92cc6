"""The C paged attention split over keys (kernels/cpu/attention.c): a decoding sequence's keys cut
into runs so both threads could work on one long chat, the partials merged in key order (off by
default: measured slower here). Held to the torch reference (gather, mask, fp32 softmax) split or
not; the split depends on the sequence alone, so it gets the same bits alone or in a batch."""
from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.cpu import attention as kernel

HQ, HK, D, BS, NB = 9, 3, 64, 16, 160


@pytest.fixture(autouse=True)
def _split_mode_restored():
    assert kernel.available()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    kernel.set_split(-1)
    torch.set_num_threads(threads)


def make(seqs, dtype, seed=0):
    """seqs: (context_len, query_len) each; returns q, caches, the batch (blocks shuffled)."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(HK, NB, BS, D, generator=g).to(dtype)
    v_cache = torch.randn(HK, NB, BS, D, generator=g).to(dtype)
    free = torch.randperm(NB, generator=g).tolist()
    rows, entries, start = 0, [], 0
    for ctx, n in seqs:
        nb = -(-(ctx + n) // BS)
        entries.append((start, n, ctx, [free.pop() for _ in range(nb)]))
        start += n
    q = (torch.randn(start, HQ, D, generator=g) * 2).to(dtype)
    return q, k_cache, v_cache, kernel.PagedBatch.build(entries, BS)


def run(q, k, v, batch, window=None):
    out = torch.zeros_like(q)
    kernel.paged_attention(q, k, v, batch, D ** -0.5, out, window)
    return out


def reference(q, k, v, batch, window=None):
    out = torch.zeros_like(q)
    kernel.paged_attention_torch(q, k, v, batch, D ** -0.5, out, window)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("split", [0, -1, 100, 256])
@pytest.mark.parametrize("seqs,window", [([(700, 1)], None), ([(700, 3)], None), ([(900, 1)], 150),
                                         ([(300, 1), (5, 2)], None)])
def test_split_matches_the_reference(dtype, tol, split, seqs, window):
    kernel.set_split(split)
    q, k, v, batch = make(seqs, dtype)
    got, ref = run(q, k, v, batch, window).float(), reference(q, k, v, batch, window).float()
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def test_split_changes_the_summation_only():
    """A split runs for one long decoding sequence and gives the unsplit result up to fp32
    rounding, not bit for bit (else this test would not see it run); 0 and -1 never split."""
    q, k, v, batch = make([(1000, 1)], torch.float32)
    kernel.set_split(-1)
    whole = run(q, k, v, batch)
    kernel.set_split(0)
    assert torch.equal(run(q, k, v, batch), whole)
    kernel.set_split(256)
    split = run(q, k, v, batch)
    torch.testing.assert_close(split, whole, atol=2e-6, rtol=2e-6)
    assert not torch.equal(split, whole)


@pytest.mark.parametrize("split", [-1, 128, 256])
def test_split_is_batch_invariant(split):
    kernel.set_split(split)
    q, k, v, batch = make([(600, 1)], torch.float32, seed=3)
    alone = run(q, k, v, batch)
    # the same sequence (same q, same cache blocks) after three others in one step
    others = [(50, 2), (700, 1), (10, 4)]
    q2, k2, v2, _ = make(others, torch.float32, seed=4)
    entries = []
    start = 0
    used = set(batch.block_ids.tolist())
    free = [b for b in range(NB) if b not in used]
    for ctx, n in others:
        nb = -(-(ctx + n) // BS)
        entries.append((start, n, ctx, [free.pop() for _ in range(nb)]))
        start += n
    entries.append((start, 1, 600, batch.block_ids.tolist()))
    both = kernel.PagedBatch.build(entries, BS)
    q_all = torch.cat([q2, q])
    out = run(q_all, k, v, both)
    assert torch.equal(out[start:], alone)


def test_bad_split_is_refused():
    with pytest.raises(ValueError, match="split keys must be -1, 0 or positive"):
        kernel.set_split(-5)
