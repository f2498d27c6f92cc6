"""The CPU paged-attention backend against dense per-request attention.

Requests' blocks sit shuffled in the cache; group and query-block sizes are shrunk so that one
step exercises several decode groups (with padding and masking), several query blocks of a prefill
chunk, and a chunk after cached context.
"""
from __future__ import annotations

import random

import pytest
import torch

import asyncengine.layers.attention as A

HQ, HK, D, BS = 8, 2, 16, 4


def dense(q, k, v, context_len):
    """q: [n, Hq, D] at positions context_len.., k/v: [context_len + n, Hk, D]; causal, fp64."""
    total = k.shape[0]
    g = HQ // HK
    qd, kd, vd = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = torch.einsum("qhd,khd->hqk", qd, kd) * D ** -0.5
    allowed = torch.arange(total)[None, :] <= torch.arange(context_len, total)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_matches_dense(monkeypatch, dtype):
    monkeypatch.setattr(A, "DECODE_GROUP_TOKENS", 64)  # several groups at these lengths
    monkeypatch.setattr(A, "PREFILL_QUERY_BLOCK", 8)  # several query blocks per chunk
    A._TRIANGLES.clear()
    rng = random.Random(0)
    torch.manual_seed(0)
    decode_lens = sorted([rng.randint(1, 40) for _ in range(9)] + [16, 16], reverse=True)  # incl. full blocks
    prefills = [(0, 13), (11, 21)]  # (cached context, new tokens)
    lens = decode_lens + [c + n for c, n in prefills]
    num_blocks = sum(-(-s // BS) for s in lens) + 5
    free = list(range(1, num_blocks))  # block 0 stays unused: padding points at it
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // BS))] for s in lens]

    k_cache = torch.zeros(A.TorchPagedAttention.kv_cache_shape(num_blocks, BS, HK, D), dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    keys = [torch.randn(s, HK, D).to(dtype) for s in lens]
    vals = [torch.randn(s, HK, D).to(dtype) for s in lens]

    def slot(r, p):
        return tables[r][p // BS] * BS + p % BS

    # the cache holds everything but this step's tokens (written by forward)
    new_rows = [(r, s - 1, s) for r, s in enumerate(decode_lens)]
    new_rows += [(len(decode_lens) + i, c, c + n) for i, (c, n) in enumerate(prefills)]
    for r, first_new, _ in new_rows:
        for p in range(first_new):
            k_cache.view(HK, -1, D)[:, slot(r, p)] = keys[r][p]
            v_cache.view(HK, -1, D)[:, slot(r, p)] = vals[r][p]

    q_parts, k_parts, v_parts, slots = [], [], [], []
    for r, a, b in new_rows:
        q_parts.append(torch.randn(b - a, HQ, D).to(dtype))
        k_parts.append(keys[r][a:b])
        v_parts.append(vals[r][a:b])
        slots += [slot(r, p) for p in range(a, b)]
    q, k, v = torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts)

    nd = len(decode_lens)
    meta = A.AttentionMetadata(slot_mapping=torch.tensor(slots), num_decodes=nd)
    meta.decode_groups = A.build_decode_groups(tables[:nd], decode_lens, BS, HK, HQ // HK, num_blocks,
                                               torch.device("cpu"))
    assert len(meta.decode_groups) > 2 and any(g.key_bias is not None for g in meta.decode_groups)
    row = nd
    for i, (c, n) in enumerate(prefills):
        meta.prefills.append(A.PrefillChunk(row, row + n, c, torch.tensor(tables[nd + i])))
        row += n
    attn = A.TorchPagedAttention(HQ, HK, D, D ** -0.5)
    out = attn.forward(q, k, v, (k_cache, v_cache), meta).view(-1, HQ, D)

    tol = 1e-5 if dtype == torch.float32 else 3e-2
    start = 0
    for (r, a, b), qp in zip(new_rows, q_parts):
        want = dense(qp, keys[r][:b], vals[r][:b], a)
        got = out[start:start + (b - a)].double()
        assert torch.allclose(got, want, atol=tol, rtol=tol), f"request {r}: {(got - want).abs().max()}"
        start += b - a


def test_plan_decode_groups_bounds_padding_and_size():
    nblocks = [50, 48, 40, 37, 36, 20, 3, 3, 1]
    groups = A.plan_decode_groups(nblocks, 16, max_tokens=2048, fill=0.75)
    assert [(s, e) for s, e, _ in groups] == [(0, 2), (2, 5), (5, 6), (6, 8), (8, 9)]
    for s, e, mb in groups:
        assert mb == nblocks[s] and all(nblocks[i] >= 0.75 * mb for i in range(s, e))
        assert e - s == 1 or (e - s) * mb * 16 <= 2048
