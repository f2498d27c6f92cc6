"""Pooling a packed batch of hidden states into one vector per sequence (embeddings).

A pooling request runs its prompt like any other; what it returns is not a sampled token but its
hidden states reduced to one vector. The batch is packed (sequences back to back, as the runner
lays them out), so every reduction takes ``query_start_loc`` (cumulative starts, length n + 1)
and works on all sequences at once: no per-request Python loop over tokens.

Order of the post-processing follows sentence-transformers: pool, truncate to ``dimensions``
(Matryoshka models are trained so a prefix is itself an embedding), then L2-normalise."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncengine.pooling_params import POOLING_TYPES, PoolingSpec, PoolingType  # noqa: F401 (re-exported)


def _seq_index(query_start_loc: torch.Tensor, total: int) -> torch.Tensor:
    """The sequence each packed token belongs to (int64, length ``total``)."""
    lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=total)


def pool_hidden(hidden: torch.Tensor, query_start_loc: torch.Tensor, pooling: str) -> torch.Tensor:
    """[tokens, hidden] packed -> [n, hidden] with one pooling for all sequences.

    ``mean`` sums in float32 (a long prompt in bf16 would lose the tail's contribution)."""
    starts = query_start_loc[:-1].to(torch.int64)
    ends = query_start_loc[1:].to(torch.int64)
    if bool((ends <= starts).any()):
        raise ValueError("every pooled sequence needs at least one token")
    if pooling == "cls":
        return hidden.index_select(0, starts)
    if pooling == "last":
        return hidden.index_select(0, ends - 1)
    if pooling == "mean":
        seq = _seq_index(query_start_loc, hidden.shape[0])
        sums = torch.zeros(starts.numel(), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seq, hidden.to(torch.float32))
        return (sums / (ends - starts).unsqueeze(1).to(torch.float32)).to(hidden.dtype)
    raise ValueError(f"unknown pooling {pooling!r}")


def finish_embedding(pooled: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Truncate (Matryoshka) then L2-normalise one or more pooled rows, in float32."""
    out = pooled.to(torch.float32)
    if dimensions is not None:
        out = out[..., :dimensions]
    if normalize:
        out = F.normalize(out, p=2, dim=-1)
    return out


def pool_batch(hidden: torch.Tensor, query_start_loc: torch.Tensor,
               specs: list[PoolingSpec]) -> list[torch.Tensor]:
    """One float32 embedding per sequence, each by its own spec (requests in a batch differ).

    Sequences sharing a pooling kind are reduced together; the per-request tail (truncate,
    normalise) is a cheap per-row op."""
    if len(specs) != query_start_loc.numel() - 1:
        raise ValueError(f"{len(specs)} pooling specs for {query_start_loc.numel() - 1} sequences")
    out: list[torch.Tensor | None] = [None] * len(specs)
    for kind in {s.pooling for s in specs}:
        pooled = pool_hidden(hidden, query_start_loc, kind)
        for i, s in enumerate(specs):
            if s.pooling == kind:
                out[i] = finish_embedding(pooled[i], s.normalize, s.dimensions)
    return out  # type: ignore[return-value]
