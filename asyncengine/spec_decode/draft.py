"""A draft model proposer: a smaller model with the same tokenizer, run by the worker next to the
target, on its own paged KV cache.

The draft's cache has the target's geometry in blocks (same count, same block size) and uses the
target's block tables: every slot the scheduler gave a request holds that request's draft KV too,
so the draft needs no allocator of its own, and prefix-cache hits and preemption carry over (a block
the prefix cache shares was computed by the draft as well: the draft runs on every position the
target computes). Per request it remembers how far its KV is valid (``computed``); each step it
catches up to the target's position (1 token after a decode, 2 after every draft was accepted, the
chunk of a prefill) in one flat forward, then proposes k tokens greedily, one small forward each.
Greedy drafts are point-mass proposals: for them rejection sampling is exactly "accept a draft iff
the target's own sample equals it", which the runner does.
"""
from __future__ import annotations

import torch

from asyncengine.attention.backend import SeqChunk, StepBatch
from asyncengine.attention.kv_cache import kv_cache_zeros
from asyncengine.attention.selector import get_model_backend
from asyncengine.spec_decode.proposer import Proposer, Rows


class DraftModelProposer(Proposer):
    runs_every_step = True

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, backend_name: str = "torch") -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        a = model.args
        # the draft's own paged cache, laid out by the same attention backend as the target's
        self.backend = get_model_backend(backend_name, a, num_heads=model.num_heads,
                                         num_kv_heads=model.num_kv_heads, head_dim=a.head_dim,
                                         block_size=block_size, num_blocks=num_blocks, dtype=dtype,
                                         device=device, scale=getattr(a, "attn_scale", None))
        self.kv_caches = self.backend.allocate_kv_caches(a.num_layers, kv_cache_zeros)
        self.computed: dict[str, int] = {}  # req_id -> positions [0, n) of valid draft KV
        self.num_tokens_processed = 0  # every position the draft ran on (tests: no recompute)
        self.num_forwards = 0

    def add(self, req_id: str, num_computed: int) -> None:
        """A request the target starts at ``num_computed`` (a prefix hit: the draft computed those
        blocks when their first owner ran)."""
        self.computed[req_id] = num_computed

    def forget(self, req_id: str) -> None:
        self.computed.pop(req_id, None)

    def reset(self) -> None:
        self.computed.clear()

    def propose_step(self, decodes: list, prefills: Rows, specs: Rows) -> list[list[int]]:
        """Catches the draft KV up on every row the target computes; drafts for the spec rows."""
        rows = [(st, st.num_computed_tokens + 1, 0) for st in decodes]
        rows += [(st, st.num_computed_tokens + n, 0) for st, n in prefills]
        rows += [(st, st.num_computed_tokens + 1, k) for st, k in specs]
        return self.propose(rows)

    def _forward(self, chunks) -> torch.Tensor:
        """chunks: (block ids, first position, token ids); returns the hidden state of each chunk's
        last token."""
        bs = self.block_size
        ids, pos, slots, last = [], [], [], []
        seqs = []
        row = 0
        for blocks, start, toks in chunks:
            n = len(toks)
            end = start + n
            ids.extend(toks)
            pos.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            seqs.append(SeqChunk(query_start=row, query_len=n, context_len=start, block_ids=blocks))
            row += n
            last.append(row - 1)
        dev = self.device
        meta = self.backend.build_metadata(StepBatch(seqs=seqs, slot_mapping=slots, num_decodes=0))
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.tensor(pos, dtype=torch.long, device=dev), self.kv_caches, meta)
        self.num_tokens_processed += row
        self.num_forwards += 1
        return hidden[torch.tensor(last, dtype=torch.long, device=dev)]

    @torch.inference_mode()
    def propose(self, rows) -> list[list[int]]:
        """rows: (runner state, end, k) for every request the target computes this step, ``end``
        the end of the target's real (non-draft) tokens. Catches the draft KV up to ``end``; returns
        k greedy drafts for each row with k > 0 (in order)."""
        chunks, spec = [], []
        for st, end, k in rows:
            start = min(self.computed.get(st.req_id, 0), end - 1) if k else self.computed.get(st.req_id, 0)
            if start < end:
                chunks.append((st.block_ids, start, st.tokens(start, end)))
                if k:
                    spec.append((st, end, k, len(chunks) - 1))
            self.computed[st.req_id] = end
        if not chunks:
            return []
        hidden = self._forward(chunks)
        drafts = [[] for _ in spec]
        if not spec:
            return drafts
        idx = torch.tensor([c for *_, c in spec], dtype=torch.long, device=self.device)
        toks = self.model.compute_logits(hidden[idx]).argmax(dim=-1).tolist()
        for j, t in enumerate(toks):
            drafts[j].append(t)
        kmax = max(k for _, _, k, _ in spec)
        for i in range(1, kmax):  # feed draft i-1 at position end - 1 + i, get draft i
            live = [j for j, (_, _, k, _) in enumerate(spec) if k > i]
            hidden = self._forward([(spec[j][0].block_ids, spec[j][1] - 1 + i, [drafts[j][-1]]) for j in live])
            toks = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for j, t in zip(live, toks):
                drafts[j].append(t)
        return drafts

    def accepted(self, req_id: str, start: int, num_accepted: int, k: int) -> None:
        """The target accepted ``num_accepted`` tokens (drafts + its own) at a row whose last real
        token sat at ``start`` with ``k`` drafts: the draft KV is valid where it saw accepted drafts."""
        self.computed[req_id] = start + min(num_accepted, k)
