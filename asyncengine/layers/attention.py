"""Attention over the paged KV cache.

The runner builds one :class:`AttentionMetadata` per step; each layer then calls
``backend.forward(q, k, v, kv_cache, meta)``. The batch is flat and unpadded: the runner puts the
decode rows (one query token each) first, then the prefill chunks.

CPU backend (torch): new K/V go into their cache slots with one ``index_copy_``; decodes are
attended together in one batched matmul over their gathered block tables (keys past a request's
length masked); each prefill chunk attends with SDPA, causally over its own tokens and over its
cached context. No dense mask over all requests' keys is ever built: attention cost is the sum over
requests, not the product of the batch's totals.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    q_start: int  # row range in the flat batch
    q_end: int
    context_len: int  # tokens of this request already in the cache before this chunk
    block_ids: torch.Tensor  # [num_blocks] int64: enough blocks for context_len + chunk length


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every new token
    num_decodes: int  # the first num_decodes rows are single-token decodes
    decode_block_table: torch.Tensor | None = None  # [D, max_blocks] int64
    decode_key_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks*block_size] bool (True = attend)
    prefills: list[PrefillChunk] = field(default_factory=list)


class TorchPagedAttention:
    """Reference-quality paged attention in plain torch; the CPU backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: ([blocks, bs, Hkv, D], same). Returns [T, Hq*D]."""
        k_cache, v_cache = kv_cache
        hk, d = self.num_kv_heads, self.head_dim
        k_cache.view(-1, hk, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, hk, d).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        for ch in meta.prefills:
            out[ch.q_start:ch.q_end] = self._prefill(q[ch.q_start:ch.q_end], k[ch.q_start:ch.q_end],
                                                     v[ch.q_start:ch.q_end], k_cache, v_cache, ch)
        return out.view(q.shape[0], -1)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        nd = q.shape[0]
        hk, d, g = self.num_kv_heads, self.head_dim, self.group
        table = meta.decode_block_table
        keys = k_cache[table].view(nd, -1, hk, d).transpose(1, 2)  # [D, Hkv, L, d]
        vals = v_cache[table].view(nd, -1, hk, d).transpose(1, 2)
        qg = q.view(nd, hk, g, d)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scale  # [D, Hkv, g, L]
        scores.masked_fill_(~meta.decode_key_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vals.dtype)
        return torch.matmul(probs, vals).view(nd, hk * g, d)

    def _prefill(self, q, k, v, k_cache, v_cache, ch: PrefillChunk) -> torch.Tensor:
        n = q.shape[0]
        hk, d = self.num_kv_heads, self.head_dim
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, d]
        if ch.context_len == 0:
            kh = k.transpose(0, 1).unsqueeze(0)
            vh = v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale,
                                               enable_gqa=self.group > 1)
        else:
            total = ch.context_len + n
            kh = k_cache[ch.block_ids].view(-1, hk, d)[:total].transpose(0, 1).unsqueeze(0)
            vh = v_cache[ch.block_ids].view(-1, hk, d)[:total].transpose(0, 1).unsqueeze(0)
            qpos = torch.arange(ch.context_len, total)
            mask = torch.arange(total)[None, :] <= qpos[:, None]  # [n, total]
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale,
                                               enable_gqa=self.group > 1)
        return o.squeeze(0).transpose(0, 1)
