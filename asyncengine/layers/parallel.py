"""Tensor-parallel plumbing for the model code: which rank this process is, the collectives the
Megatron split needs, and the arithmetic of who holds which heads, columns and vocabulary rows.

A model is built with a :class:`TPGroup`; ``SINGLE`` (size 1) turns every collective into a no-op,
so the TP=1 path runs exactly the code it always did. The process group itself is created by the
worker (``torch.distributed``: gloo on CPU, NCCL on CUDA); models never create one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncengine.errors import ConfigError


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup when size > 1
    # embedding and LM head split by vocabulary rows (False: every rank holds them whole, rank 0
    # alone computes the logits; EngineConfig.tp_vocab_parallel, docs/distributed.md)
    vocab_parallel: bool = True
    # batch-invariant mode: all-reduce sums the ranks' parts in rank order (gloo's ring reduces each
    # slice of the tensor starting at a different rank, and where the slices fall depends on the
    # tensor's size, so on the batch, from 3 ranks up)
    fixed_order: bool = False
    # mixture-of-experts layers: each rank holds 1/size of the experts whole, not 1/size of every
    # expert (EngineConfig.enable_expert_parallel, layers/moe.py)
    expert_parallel: bool = False

    @property
    def vocab_sharded(self) -> bool:
        return self.size > 1 and self.vocab_parallel

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial result (row-parallel layers), in place."""
        if self.size > 1:
            import torch.distributed as dist

            if not self.fixed_order:
                dist.all_reduce(x, group=self.group)
                return x
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            x.copy_(parts[0])
            for p in parts[1:]:
                x.add_(p)
        return x

    def gather_to_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's slice along ``dim`` on rank 0 (None elsewhere): the
        vocab-parallel LM head's logits only need to reach the rank that samples."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                    group=self.group)
        return torch.cat(parts, dim=dim) if self.rank == 0 else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor on every rank (the sampled ids, so every rank's runner state advances)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.broadcast(x, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                           group=self.group)
        return x


SINGLE = TPGroup()


@dataclass(frozen=True)
class AttentionShard:
    """This rank's share of the attention heads."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # kv heads on this rank (1 when kv heads are replicated)
    q_head_start: int
    kv_head_start: int


def attention_shard(num_heads: int, num_kv_heads: int, tp: TPGroup) -> AttentionShard:
    """Split query heads evenly; split kv heads evenly, or, when there are fewer kv heads than
    ranks, give each rank a copy of the one kv head its query heads use (as vLLM does)."""
    n = tp.size
    if num_heads % n:
        raise ConfigError(
            f"tensor_parallel_size={n} does not divide the model's {num_heads} query heads: every rank "
            f"must hold whole heads (try a size that divides {num_heads})")
    if num_kv_heads >= n:
        if num_kv_heads % n:
            raise ConfigError(
                f"tensor_parallel_size={n} does not divide the model's {num_kv_heads} KV heads "
                f"(and is not a multiple of it, which would replicate them)")
        kv_local = num_kv_heads // n
        kv_start = tp.rank * kv_local
    else:
        if n % num_kv_heads:
            raise ConfigError(
                f"tensor_parallel_size={n} is neither a divisor nor a multiple of the model's "
                f"{num_kv_heads} KV heads: KV heads cannot be split or replicated evenly")
        kv_local = 1
        kv_start = tp.rank // (n // num_kv_heads)
    hq = num_heads // n
    return AttentionShard(num_heads=hq, num_kv_heads=kv_local, q_head_start=tp.rank * hq, kv_head_start=kv_start)


def even_split(total: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """(start, size) of this rank's share of ``total`` columns that must divide evenly."""
    if total % tp.size:
        raise ConfigError(f"tensor_parallel_size={tp.size} does not divide the model's {what} ({total})")
    size = total // tp.size
    return tp.rank * size, size


def vocab_split(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """(start, stop, padded rows per rank) of this rank's vocabulary slice; the last rank's may be
    shorter than the padded size (its extra rows stay zero and are cut from the logits). The
    whole vocabulary when it is replicated."""
    if not tp.vocab_sharded:
        return 0, vocab_size, vocab_size
    per = -(-vocab_size // tp.size)
    start = min(tp.rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


@dataclass(frozen=True)
class PPGroup:
    """This rank's pipeline stage: which layers it holds, and its neighbours' global ranks (the
    same tensor-parallel rank of the previous and next stage). ``FULL`` (size 1): every layer, no
    neighbours. Hidden states and residual cross stages by point-to-point sends (gloo on CPU)."""

    rank: int = 0  # the stage
    size: int = 1
    prev_rank: int | None = None
    next_rank: int | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of this stage's layers: an even split, the first stages taking one more
        when it does not divide (the last stage also runs the norm, the head and the sampler)."""
        return layer_split(num_layers, self.size)[self.rank]


def layer_split(num_layers: int, stages: int) -> list[tuple[int, int]]:
    if num_layers < stages:
        raise ConfigError(f"pipeline_parallel_size={stages} is more than the model's {num_layers} layers: "
                          f"every stage must hold at least one")
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (s < extra)
        out.append((start, start + n))
        start += n
    return out


FULL = PPGroup()
