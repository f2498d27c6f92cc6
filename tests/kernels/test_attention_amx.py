"""kernels/cpu/attention_amx.c, the tile-product attention of the ``amx_bf16`` level, forced on the
machine the test runs on (skipped only where cpuid / the OS say the level is absent), against dense
fp64 attention and the ``avx512_bf16`` loops: long prefills (several 64-row items, many 64-key
chunks), chunked prefill over a context, decodes with their grouped heads in one tile, windows,
soft-capping, head dims 64 / 128 / 96, blocks of 16 and 64, and NaN in the stale slots past a
sequence's end (they must never reach an output)."""
from __future__ import annotations

import pytest
import torch
from test_cpu_kernels import cached, dense

from asyncengine.kernels.cpu import attention as A
from asyncengine.kernels.cpu import build, isa


@pytest.fixture(scope="module", autouse=True)
def amx_level():
    if not A.available():
        pytest.fail(f"the CPU kernels did not build here: {build.build_error()}", pytrace=False)
    if isa.ISAS.index(isa.cpu_isa()) < isa.ISAS.index("amx_bf16"):
        pytest.skip(f"this CPU (or its OS) runs at most {isa.cpu_isa()}: no AMX tiles granted")
    yield
    isa.set_isa("auto")


def _step(hq, hk, d, bs, spec, seed):
    """q and shuffled paged caches for sequences (query_len, context_len); the slots past each
    sequence's last key in its last block hold NaN."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-(c + n) // bs) for n, c in spec]
    nb = sum(per) + 2
    k = torch.randn(hk, nb, bs, d, generator=g).bfloat16()
    v = torch.randn(hk, nb, bs, d, generator=g).bfloat16()
    perm = torch.randperm(nb, generator=g).tolist()
    seqs, used, row = [], 0, 0
    for (n, c), p in zip(spec, per):
        blocks = perm[used:used + p]
        used += p
        tail = (c + n) % bs
        if tail:
            k[:, blocks[-1], tail:] = float("nan")
            v[:, blocks[-1], tail:] = float("nan")
        seqs.append((row, n, c, blocks))
        row += n
    q = torch.randn(row, hq, d, generator=g).bfloat16()
    return q, k, v, seqs


@pytest.mark.parametrize("hq,hk,d,bs", [(16, 4, 64, 16), (8, 2, 128, 64), (6, 3, 96, 32)])
@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 2.0)])
def test_tiles_match_dense_and_the_vector_loops(hq, hk, d, bs, window, softcap):
    spec = [(150, 0), (1, 300), (37, 90), (1, 5), (3, 64)]  # prefill, decode, chunk, short decode, spec rows
    q, k, v, seqs = _step(hq, hk, d, bs, spec, seed=hq + d + bs)
    if softcap:
        q = q * 4  # scores of several units: the cap bites
    batch = A.PagedBatch.build(seqs, bs)
    scale = d ** -0.5
    outs = {}
    for level in ("avx512_bf16", "amx_bf16"):
        assert isa.set_isa(level) == level
        outs[level] = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
        kc, vc = (k, v) if level == "amx_bf16" else (k.nan_to_num(0.0), v.nan_to_num(0.0))  # (0 * NaN there)
        A.paged_attention(q, kc, vc, batch, scale, outs[level], window, softcap=softcap)
    tiles = outs["amx_bf16"]
    assert torch.isfinite(tiles.float()).all()
    for q0, n, c, blocks in seqs:
        want = dense(q[q0:q0 + n], cached(k, blocks, c + n, bs), cached(v, blocks, c + n, bs), c, scale, window,
                     softcap=softcap)
        torch.testing.assert_close(tiles[q0:q0 + n].double(), want, atol=2e-2, rtol=2e-2)
    # P is rounded to bf16 for the P V product: close to the vector loops, not their bits
    torch.testing.assert_close(tiles.float(), outs["avx512_bf16"].float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(tiles, outs["avx512_bf16"])  # the tile path did run


def test_a_sequence_gets_the_same_bits_alone_and_batched():
    """Rows of other sequences, and a sequence's own rows in other items, add exactly nothing."""
    isa.set_isa("amx_bf16")
    q, k, v, seqs = _step(8, 2, 64, 16, [(70, 0), (1, 200), (20, 45)], seed=3)
    together = torch.empty(q.shape, dtype=torch.bfloat16)
    A.paged_attention(q, k, v, A.PagedBatch.build(seqs, 16), 0.125, together)
    for q0, n, c, blocks in seqs:
        alone = torch.zeros(q.shape, dtype=torch.bfloat16)
        A.paged_attention(q, k, v, A.PagedBatch.build([(q0, n, c, blocks)], 16), 0.125, alone)
        assert torch.equal(alone[q0:q0 + n], together[q0:q0 + n])


def test_fp32_caches_keep_the_exact_path():
    """The tile level changes nothing for fp32 (its parity with transformers is token-exact)."""
    q, k, v, seqs = _step(8, 2, 64, 16, [(40, 0), (1, 100)], seed=4)
    q, k, v = q.float(), k.float(), v.float()
    batch = A.PagedBatch.build(seqs, 16)
    outs = []
    for level in ("avx512_bf16", "amx_bf16"):
        isa.set_isa(level)
        out = torch.empty(q.shape)
        A.paged_attention(q, k, v, batch, 0.125, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
