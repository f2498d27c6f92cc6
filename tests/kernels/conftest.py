"""Kernel tests: Triton kernels against their torch references.

Without CUDA (CI, dev boxes) the kernels run in triton's CPU interpreter on CPU tensors: every test here
gets ``TRITON_INTERPRET=1`` through an autouse fixture (scoped to these tests only, so other test modules
in the same session never see it; ``asyncengine.kernels`` hands kernels to ``triton.jit`` at launch time,
so the variable only needs to be set when the kernel is called). On a CUDA machine the kernels are
compiled and run on the GPU, unless TRITON_INTERPRET=1 is already set.

triton itself is a hard requirement of these tests (it is in the dev extra): a missing triton is an
error, not a skip.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")

TRITON_HINT = (
    "the kernel tests need triton (CPU interpreter mode, TRITON_INTERPRET=1, needs no GPU): "
    "`pip install triton` or `pip install -e '.[dev]'`"
)


@pytest.fixture(autouse=True)
def _triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail (never skip) without triton; run kernels in the CPU interpreter when there is no CUDA."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError as e:  # pragma: no cover - only on a dev env without the dev extra
        pytest.fail(f"{TRITON_HINT} ({e})", pytrace=False)
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T (+ pad), Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    keys: list[torch.Tensor]  # per request, dense [seq_len, Hkv, D] (what the cache holds)
    values: list[torch.Tensor]
    q_lens: list[int]
    scale: float

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_table, self.seq_lens, self.query_start_loc, self.scale)


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device = DEVICE,
    seed: int = 0,
    spare_blocks: int = 3,
    pad_tokens: int = 0,
    strided_q: bool = False,
    nan_fill: bool = True,
) -> PagedBatch:
    """A batch whose K/V already sit in a paged cache at shuffled (non-contiguous) physical blocks.

    Cache slots that belong to no request hold NaN (``nan_fill``) and unused block-table entries hold an
    out-of-range block id, so a kernel that reads anything outside a request's context fails loudly.
    """
    from asyncengine.kernels import reshape_and_cache_ref

    assert len(q_lens) == len(seq_lens) and all(0 <= q <= s for q, s in zip(q_lens, seq_lens))
    g = torch.Generator().manual_seed(seed)
    num_seqs = len(q_lens)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_needed, default=0) + 1  # one extra (unused) column
    num_blocks = sum(blocks_needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.full((num_seqs, max_blocks), 10**6, dtype=torch.int32)  # garbage: must never be read
    nxt = 0
    for b, n in enumerate(blocks_needed):
        block_table[b, :n] = perm[nxt:nxt + n].to(torch.int32)
        nxt += n

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    fill = float("nan") if nan_fill else 0.0
    k_cache = torch.full(shape, fill, dtype=dtype)
    v_cache = torch.full(shape, fill, dtype=dtype)
    keys, values = [], []
    for b, s in enumerate(seq_lens):
        k = torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype)
        pos = torch.arange(s)
        slots = block_table[b, pos // block_size].long() * block_size + pos % block_size
        reshape_and_cache_ref(k, v, k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)

    total = sum(q_lens)
    rows = total + pad_tokens
    if strided_q:  # q as a slice of a wider fused projection: row stride != Hq * D
        base = torch.randn(rows, num_q_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
        q = base[:, :num_q_heads]
    else:
        q = torch.randn(rows, num_q_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    return PagedBatch(
        q=q.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        block_table=block_table.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device), keys=[k.to(device) for k in keys], values=[v.to(device) for v in values],
        q_lens=list(q_lens), scale=head_dim ** -0.5,
    )


@pytest.fixture
def paged_batch():
    """Factory fixture: ``paged_batch(q_lens, seq_lens, num_q_heads=..., ...)`` -> PagedBatch."""
    return make_paged_batch
