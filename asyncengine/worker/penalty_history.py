"""The token ids the penalties look at, kept on the device across steps.

Why: the repetition penalty reads a request's prompt and outputs, the presence and frequency
penalties its outputs. Rebuilding those id tables from Python lists every step costs time in
proportion to the tokens (about 10 ms a step for 256 rows of 350 tokens); the engine's default
sampling has a presence penalty, so every chat request pays it. Here each penalized request owns a
row of two device buffers (prompt ids, written once; output ids, appended as the request
generates), and a step's tables are one gather of the batch's rows.

The tables are the ones :meth:`SamplingMetadata._build_penalties` makes from the lists (the same
ids in the same order, the padding pointing at a real id of the row with a zero frequency weight),
so the penalized logits are bitwise the same.
"""
from __future__ import annotations

import torch

from asyncengine.worker.sampling_metadata import SamplingMetadata

__all__ = ["PenaltyHistory"]


def _grown(buf: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``buf`` [R, W] copied into a zeroed [max(R, rows), max(W, width)], sizes doubled."""
    R, W = buf.shape
    if rows <= R and width <= W:
        return buf
    new = torch.zeros((max(rows, 2 * R) if rows > R else R, max(width, 2 * W) if width > W else W),
                      dtype=buf.dtype, device=buf.device)
    new[:R, :W] = buf
    return new


class PenaltyHistory:
    """One slot per penalized request: its prompt and output ids on the device.

    ``synced`` counts the entries of the request's output list already on the device: each step
    appends only the new ones (one, or a few after accepted drafts); a list shorter than that (a
    request re-sent with fewer outputs) has its row rewritten.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._n_prompt: list[int] = []
        self._n_out: list[int] = []  # ids stored (in-vocabulary ones)
        self._synced: list[int] = []  # entries of the output list seen
        self._prompt = torch.zeros((0, 16), dtype=torch.int64, device=self.device)
        self._out = torch.zeros((0, 16), dtype=torch.int64, device=self.device)

    def __len__(self) -> int:
        return len(self._slot)

    def forget(self, req_id: str) -> None:
        slot = self._slot.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        self._free.extend(self._slot.values())
        self._slot.clear()

    def _new_slot(self, req_id: str, prompt: list[int]) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._n_out)
            self._n_prompt.append(0)
            self._n_out.append(0)
            self._synced.append(0)
        V = self.vocab_size
        ids = [t for t in prompt if 0 <= t < V]
        self._prompt = _grown(self._prompt, slot + 1, len(ids))
        self._out = _grown(self._out, slot + 1, 1)
        if ids:
            self._prompt[slot, :len(ids)] = torch.tensor(ids, dtype=torch.int64, device=self.device)
        self._n_prompt[slot], self._n_out[slot], self._synced[slot] = len(ids), 0, 0
        self._slot[req_id] = slot
        return slot

    def _sync(self, rows: list[int], req_ids, prompts, outputs, params) -> list[int]:
        """Each row's slot, after appending its new outputs (one scatter for the whole batch).
        Only a repetition penalty reads the prompt: the others' prompts are not stored."""
        V = self.vocab_size
        slots: list[int] = []
        at_s: list[int] = []
        at_pos: list[int] = []
        at_tok: list[int] = []
        for i in rows:
            rid = req_ids[i]
            slot = self._slot.get(rid)
            if slot is None:
                slot = self._new_slot(rid, prompts[i] if params[i].repetition_penalty != 1.0 else ())
            slots.append(slot)
            out = outputs[i]
            seen = self._synced[slot]
            if len(out) == seen:
                continue
            if len(out) < seen:  # fewer outputs than seen: rewrite the row
                seen = self._n_out[slot] = 0
            n = self._n_out[slot]
            for t in out[seen:]:
                if 0 <= t < V:
                    at_s.append(slot)
                    at_pos.append(n)
                    at_tok.append(t)
                    n += 1
            self._n_out[slot], self._synced[slot] = n, len(out)
        if at_s:
            self._out = _grown(self._out, len(self._n_out), max(at_pos) + 1)
            self._out.index_put_((torch.tensor(at_s, device=self.device), torch.tensor(at_pos, device=self.device)),
                                 torch.tensor(at_tok, dtype=torch.int64, device=self.device))
        return slots

    def fill(self, meta: SamplingMetadata, req_ids, prompts, outputs) -> None:
        """Set ``meta``'s penalty tables for its penalized rows (``meta._pen_rows``) from the
        device history; ``req_ids[i]``, ``prompts[i]``, ``outputs[i]`` describe row ``i``."""
        rows, params = meta._pen_rows, meta._pen_params
        slots = self._sync(rows, req_ids, prompts, outputs, params)
        rep = [(i, s) for i, s in zip(rows, slots) if params[i].repetition_penalty != 1.0
               and (self._n_prompt[s] or self._n_out[s])]
        fp = [(i, s) for i, s in zip(rows, slots) if self._n_out[s] and (
            params[i].presence_penalty != 0.0 or params[i].frequency_penalty != 0.0)]
        dev = self.device

        def table(pairs, key):
            return torch.tensor([[key(params[i])] for i, _ in pairs], dtype=torch.float32, device=dev)

        if rep:
            s_t = torch.tensor([s for _, s in rep], device=dev)
            meta.rep_rows = torch.tensor([i for i, _ in rep], device=dev).unsqueeze(1)
            meta.rep_ids = self._rows_ids(s_t, [self._n_prompt[s] for _, s in rep], [self._n_out[s] for _, s in rep])[0]
            meta.repetition_penalty = table(rep, lambda p: p.repetition_penalty)
        if fp:
            s_t = torch.tensor([s for _, s in fp], device=dev)
            meta.fp_rows = torch.tensor([i for i, _ in fp], device=dev).unsqueeze(1)
            meta.fp_ids, valid = self._rows_ids(s_t, None, [self._n_out[s] for _, s in fp])
            meta.presence_penalty = table(fp, lambda p: p.presence_penalty)
            meta.frequency_src = torch.where(valid, -table(fp, lambda p: p.frequency_penalty), 0.0)

    def _rows_ids(self, s_t: torch.Tensor, n_prompt: list[int] | None, n_out: list[int]):
        """[len(s_t), L] ids of the slots (prompt then outputs when ``n_prompt`` is given), each
        padding entry replaced by the row's first id; and the mask of the real entries."""
        dev = self.device
        lo = max(n_out)
        ids = self._out[s_t, :lo]
        valid = torch.arange(lo, device=dev) < torch.tensor(n_out, device=dev).unsqueeze(1)
        if n_prompt is not None:
            lp = max(n_prompt)
            ids = torch.cat([self._prompt[s_t, :lp], ids], dim=1)
            valid = torch.cat([torch.arange(lp, device=dev) < torch.tensor(n_prompt, device=dev).unsqueeze(1),
                               valid], dim=1)
        first = ids.gather(1, valid.to(torch.int8).argmax(dim=1, keepdim=True))
        return torch.where(valid, ids, first), valid
