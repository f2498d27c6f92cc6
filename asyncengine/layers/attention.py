"""Attention over the paged KV cache.

The runner builds one :class:`AttentionMetadata` per step; each layer then calls
``backend.forward(q, k, v, kv_cache, meta)``. The batch is flat and unpadded: the runner puts the
decode rows (one query token each) first, longest context first, then the prefill chunks.

CPU backend (torch). The cache of a layer is ``(k_cache, v_cache)``, each laid out head-major,
``[num_kv_heads, num_blocks, block_size, head_dim]`` (:meth:`TorchPagedAttention.kv_cache_shape`):
gathering a set of blocks then yields ``[heads, tokens, head_dim]`` slabs that matmul reads as is,
with no transposing copy. New K/V go into their slots with one ``index_copy_``.

Decodes are attended in groups of rows with similar context lengths (:func:`plan_decode_groups`):
per group, one ``index_select`` gathers the group's key blocks into a reused workspace (as rows of
the cache seen as a ``[heads * blocks, block_size * head_dim]`` table: that form runs on every
thread, a gather along the blocks dimension on one only), one
batched matmul makes the scores (keys past a row's length masked), and after the softmax the values
are summed in place by ``embedding_bag`` with the probabilities as weights. Grouping bounds the
padding, and a group's gathered keys (a few MiB at most) are still in cache when the matmul reads
them. Each
prefill chunk attends causally over its cached context and its own tokens, in blocks of query rows
(two matmuls and a softmax per block; faster than SDPA's CPU flash kernel at these sizes). No
dense mask over all requests' keys is ever built: attention cost is the sum over requests.

Sliding-window attention (Mistral; Qwen2's sliding layers): a layer built with ``sliding_window=W``
lets the query at position i see keys j with i - W < j <= i (transformers' rule). Keys that fell
out of the window are not freed: the cache still holds every position. Prefill skips the keys
before a query block's window; decode masks them. Soft-capping
(Gemma 2): ``softcap=c`` maps the scaled scores to ``c * tanh(s / c)`` before the masks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# A decode group's gathered keys span at most this many token slots (rows x padded length), so the
# workspace stays cache-sized; the measurements are in docs/benchmarks.md as of c019f6b.
DECODE_GROUP_TOKENS = 8192
# A row joins a group only if its context needs at least this fraction of the group's longest
# row's blocks: padding stays below 1 / DECODE_GROUP_FILL - 1 (33%) of a group's gathered keys.
DECODE_GROUP_FILL = 0.75
# Prefill attention works on blocks of at most this many query rows, fewer where the fp32 scores
# (heads x rows x keys) would exceed PREFILL_SCORES_NUMEL elements.
PREFILL_QUERY_BLOCK = 128
PREFILL_SCORES_NUMEL = 1 << 22


@dataclass
class PrefillChunk:
    q_start: int  # row range in the flat batch
    q_end: int
    context_len: int  # tokens of this request already in the cache before this chunk
    block_ids: torch.Tensor  # [num_blocks] int64: enough blocks for context_len + chunk length


@dataclass
class DecodeGroup:
    start: int  # row range [start, end) in the flat batch (and among the decodes)
    end: int
    num_blocks: int  # blocks gathered per row (the group's longest row's)
    # the key blocks to gather, as rows of the cache seen as a [Hkv * blocks, block_size * D] table
    # (kv head major, then row, then block; short rows padded with block 0)
    key_rows: torch.Tensor  # [Hkv * rows * num_blocks] int64
    key_bias: torch.Tensor | None  # [rows, 1, num_blocks * block_size] float32, 0 / -inf; None: no padding
    # the values as embedding-bag rows of the cache seen as a [Hkv * blocks * block_size, D] table:
    # one bag per (kv head, row, query head of that kv head), num_blocks * block_size slots each
    value_rows: torch.Tensor  # [Hkv * rows * group * L] int64
    value_offsets: torch.Tensor  # [Hkv * rows * group] int64: where each bag starts
    seq_lens: torch.Tensor | None = None  # [rows] int64: context lengths (sliding-window layers mask by them)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every new token
    num_decodes: int  # the first num_decodes rows are single-token decodes
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    workspace: torch.Tensor | None = None  # flat scratch (cache dtype) for gathered decode keys


def plan_decode_groups(num_blocks: list[int], block_size: int, max_tokens: int = DECODE_GROUP_TOKENS,
                       fill: float = DECODE_GROUP_FILL) -> list[tuple[int, int, int]]:
    """Split decode rows, sorted by block count descending, into ``(start, end, group_blocks)``.

    A group takes rows while they need at least ``fill`` x the first row's blocks and while
    rows x first row's tokens fit in ``max_tokens`` (every group takes at least one row)."""
    groups = []
    n = len(num_blocks)
    i = 0
    while i < n:
        mb = num_blocks[i]
        cap = max(1, max_tokens // (mb * block_size))
        j = i + 1
        while j < n and j - i < cap and num_blocks[j] >= fill * mb:
            j += 1
        groups.append((i, j, mb))
        i = j
    return groups


def build_decode_groups(block_tables: list[list[int]], seq_lens: list[int], block_size: int,
                        num_kv_heads: int, num_queries_per_kv: int, num_cache_blocks: int,
                        device: torch.device) -> list[DecodeGroup]:
    """Groups for decode rows given longest first: each row's block ids and context length
    (including the token being decoded). Built once per step; every layer uses them."""
    nblocks = [-(-s // block_size) for s in seq_lens]
    hk, g = num_kv_heads, num_queries_per_kv
    head_blocks = torch.arange(hk, device=device).view(hk, 1) * num_cache_blocks
    head_slots = head_blocks.view(hk, 1, 1, 1) * block_size
    in_block = torch.arange(block_size, device=device)
    groups = []
    for start, end, mb in plan_decode_groups(nblocks, block_size):
        n = end - start
        flat: list[int] = []
        for r in range(start, end):
            ids = block_tables[r]
            flat.extend(ids[:mb])
            flat.extend([0] * (mb - min(len(ids), mb)))
        block_ids = torch.tensor(flat, dtype=torch.long, device=device)
        key_bias = None
        length = mb * block_size
        if any(seq_lens[r] != length for r in range(start, end)):
            lens = torch.tensor(seq_lens[start:end], device=device)
            pad = torch.arange(length, device=device)[None, :] >= lens[:, None]
            key_bias = torch.zeros(n, 1, length, device=device).masked_fill_(pad.unsqueeze(1), float("-inf"))
        key_rows = (head_blocks + block_ids).view(-1)
        slots = (block_ids.view(n, mb, 1) * block_size + in_block).view(1, n, 1, length)
        value_rows = (head_slots + slots).expand(hk, n, g, length).reshape(-1)
        value_offsets = torch.arange(0, value_rows.numel(), length, device=device)
        groups.append(DecodeGroup(start, end, mb, key_rows, key_bias, value_rows, value_offsets,
                                  torch.tensor(seq_lens[start:end], device=device)))
    return groups


class TorchPagedAttention:
    """Paged attention in plain torch; the CPU backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap  # Gemma 2: scaled scores -> cap * tanh(scores / cap), before the masks

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's key (and value) cache: head-major."""
        return (num_kv_heads, num_blocks, block_size, head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: ([Hkv, blocks, bs, D], same). Returns [T, Hq*D]."""
        k_cache, v_cache = kv_cache
        hk, d = self.num_kv_heads, self.head_dim
        k_cache.view(hk, -1, d).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.view(hk, -1, d).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        out = torch.empty_like(q)
        for grp in meta.decode_groups:
            out[grp.start:grp.end] = self._decode(q[grp.start:grp.end], k_cache, v_cache, grp, meta.workspace)
        for ch in meta.prefills:
            out[ch.q_start:ch.q_end] = self._prefill(q[ch.q_start:ch.q_end], k[ch.q_start:ch.q_end],
                                                     v[ch.q_start:ch.q_end], k_cache, v_cache, ch)
        return out.view(q.shape[0], -1)

    def _decode(self, q, k_cache, v_cache, grp: DecodeGroup, workspace: torch.Tensor | None) -> torch.Tensor:
        """Keys: gathered into the workspace, then one batched matmul for the scores. Values: read
        in place, as an embedding bag per query head weighted by its probabilities (no gather:
        about 20% faster than gathering them for a second matmul)."""
        n = q.shape[0]
        hk, d, g = self.num_kv_heads, self.head_dim, self.group
        bs = k_cache.shape[2]
        length = grp.num_blocks * bs
        size = hk * n * length * d
        table = k_cache.view(-1, bs * d)  # one row per (kv head, block): gathers in parallel
        if workspace is not None and workspace.numel() >= size:
            keys = torch.index_select(table, 0, grp.key_rows, out=workspace[:size].view(-1, bs * d))
        else:
            keys = table.index_select(0, grp.key_rows)
        keys = keys.view(hk, n, length, d)
        qg = q.view(n, hk, g, d).transpose(0, 1)  # [Hkv, n, g, d]: a kv head's query heads as rows
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float()  # [Hkv, n, g, L]
        scores.mul_(self.scale)
        self._cap(scores)
        if grp.key_bias is not None:
            scores.add_(grp.key_bias)
        w = self.sliding_window
        if w is not None and length > w:
            # the row decoding position len - 1 sees keys [len - w, len)
            old = torch.arange(length, device=q.device)[None, :] < (grp.seq_lens[:, None] - w)  # [n, L]
            scores.masked_fill_(old.view(1, n, 1, length), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v_cache.dtype)
        out = F.embedding_bag(grp.value_rows, v_cache.view(-1, d), grp.value_offsets, mode="sum",
                              per_sample_weights=probs.view(-1))  # [Hkv * n * g, d]
        return out.view(hk, n, g, d).transpose(0, 1).reshape(n, hk * g, d)

    def _prefill(self, q, k, v, k_cache, v_cache, ch: PrefillChunk) -> torch.Tensor:
        """Causal attention of a chunk over its cached context and itself, in query blocks: per
        block, one matmul for the scores against every key it may see, a softmax, one matmul with
        the values. Plain matmuls run near the machine's GEMM speed; on CPU this is about twice as
        fast as SDPA's flash kernel for these shapes (docs/benchmarks.md as of c019f6b)."""
        n = q.shape[0]
        hk, d, g = self.num_kv_heads, self.head_dim, self.group
        ctx = ch.context_len
        total = ctx + n
        if ctx == 0:
            keys, vals = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()  # [Hkv, n, d]
        else:  # the cache already holds this chunk's own keys too (written in forward)
            nb, bs = k_cache.shape[1], k_cache.shape[2]
            rows = (torch.arange(hk, device=q.device).view(hk, 1) * nb + ch.block_ids).view(-1)
            keys = k_cache.view(-1, bs * d).index_select(0, rows).view(hk, -1, d)[:, :total]
            vals = v_cache.view(-1, bs * d).index_select(0, rows).view(hk, -1, d)[:, :total]
        # query rows per block: PREFILL_QUERY_BLOCK, fewer where the keys are many (bounds the fp32 scores)
        qb = min(PREFILL_QUERY_BLOCK, max(16, PREFILL_SCORES_NUMEL // (self.num_heads * total)))
        out = torch.empty_like(q)
        for i0 in range(0, n, qb):
            i1 = min(n, i0 + qb)
            b, seen = i1 - i0, ctx + i1  # this block's queries see keys [lo, ctx + i1)
            w = self.sliding_window
            # keys before the block's first query's window are skipped, not masked
            lo = 0 if w is None else max(0, ctx + i0 - w + 1)
            span = seen - lo
            qg = q[i0:i1].permute(1, 0, 2).reshape(hk, g * b, d)  # a kv head's query heads as rows
            scores = torch.matmul(qg, keys[:, lo:seen].transpose(1, 2)).float()  # [Hkv, g*b, span]
            scores.mul_(self.scale)
            self._cap(scores)
            diagonal = scores.view(hk, g, b, span)[..., ctx + i0 - lo:]  # [.., b, b]: mask above it
            diagonal.masked_fill_(_upper_triangle(b, q.device), float("-inf"))
            if w is not None and span > w:
                # the query at position p = ctx + i0 + r sees keys (p - w, p]; later rows' windows start later
                pos = torch.arange(ctx + i0, ctx + i1, device=q.device)
                old = torch.arange(lo, seen, device=q.device)[None, :] <= (pos[:, None] - w)  # [b, span]
                scores.view(hk, g, b, span).masked_fill_(old, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(vals.dtype)
            out[i0:i1] = torch.matmul(probs, vals[:, lo:seen]).view(hk * g, b, d).transpose(0, 1)
        return out


    def _cap(self, scores: torch.Tensor) -> None:
        """Soft-cap the scaled scores in place, as the reference does (divide, tanh, multiply)."""
        if self.softcap is not None:
            scores.div_(self.softcap).tanh_().mul_(self.softcap)


_TRIANGLES: dict[torch.device, torch.Tensor] = {}


def _upper_triangle(b: int, device: torch.device) -> torch.Tensor:
    """[b, b] bool, True strictly above the diagonal (the future keys of a query block)."""
    tri = _TRIANGLES.get(device)
    if tri is None or tri.shape[0] < b:
        tri = _TRIANGLES[device] = torch.ones(b, b, dtype=torch.bool, device=device).triu_(1)
    return tri[:b, :b]
