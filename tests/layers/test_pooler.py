"""Packed pooling equals pooling each sequence alone; truncation comes before normalisation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncengine.errors import InvalidRequestError
from asyncengine.layers.pooler import PoolingSpec, finish_embedding, pool_batch, pool_hidden

LENS = [3, 1, 7, 2]


def _packed(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randn(n, 16, generator=g, dtype=torch.float32).to(dtype) for n in LENS]
    qsl = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist(), dtype=torch.int32)
    return seqs, torch.cat(seqs), qsl


@pytest.mark.parametrize("pooling,ref", [
    ("cls", lambda s: s[0]), ("last", lambda s: s[-1]), ("mean", lambda s: s.mean(0))])
def test_packed_pooling_matches_each_sequence_alone(pooling, ref):
    seqs, hidden, qsl = _packed()
    got = pool_hidden(hidden, qsl, pooling)
    want = torch.stack([ref(s) for s in seqs])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_mean_in_bf16_accumulates_in_fp32():
    seqs, hidden, qsl = _packed(torch.bfloat16)
    got = pool_hidden(hidden, qsl, "mean")
    want = torch.stack([s.float().mean(0) for s in seqs]).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_truncate_then_normalize():
    v = torch.tensor([3.0, 4.0, 12.0])
    torch.testing.assert_close(finish_embedding(v, True, 2), torch.tensor([0.6, 0.8]))
    torch.testing.assert_close(finish_embedding(v, False, None), v)
    assert abs(float(finish_embedding(v, True, None).norm()) - 1.0) < 1e-6


def test_mixed_specs_in_one_batch():
    seqs, hidden, qsl = _packed()
    specs = [PoolingSpec("mean"), PoolingSpec("last", normalize=False), PoolingSpec("cls", dimensions=4),
             PoolingSpec("mean", normalize=False, dimensions=8)]
    out = pool_batch(hidden, qsl, specs)
    torch.testing.assert_close(out[0], F.normalize(seqs[0].mean(0), dim=0))
    torch.testing.assert_close(out[1], seqs[1][-1])
    torch.testing.assert_close(out[2], F.normalize(seqs[2][0, :4], dim=0))
    torch.testing.assert_close(out[3], seqs[3].mean(0)[:8])
    with pytest.raises(ValueError, match="3 pooling specs for 4"):
        pool_batch(hidden, qsl, specs[:3])


def test_empty_sequence_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        pool_hidden(torch.zeros(2, 4), torch.tensor([0, 2, 2]), "mean")


@pytest.mark.parametrize("spec,msg", [
    (PoolingSpec("max"), "pooling must be one of"), (PoolingSpec(dimensions=0), "positive integer"),
    (PoolingSpec(dimensions=True), "positive integer"), (PoolingSpec(dimensions=65), "exceeds")])
def test_bad_specs_name_the_field(spec, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        spec.validated(hidden_size=64)
    assert PoolingSpec("cls", dimensions=64).validated(64).dimensions == 64
