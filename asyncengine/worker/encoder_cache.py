"""The vision encoder's outputs, computed at a request's prefill and kept by image hash while a
request still needs them (vLLM V1's encoder cache).

Each step, for every request whose chunk covers part of an image's placeholder run, the rows it
covers are sliced from that image's encoder output: a chunk may start or end inside the run (the
scheduler cuts prefill chunks anywhere), and a prefix-cache hit may skip the run entirely (then the
image is never encoded). Images not yet encoded are encoded together, once per hash: two requests
with the same image share one output. An output is released when no request of the runner needs it
any more (past its run, finished or preempted); released outputs stay, least recently used first
out, while the cache holds at most ``budget_tokens`` rows."""
from __future__ import annotations

from collections import OrderedDict

import torch

from asyncengine.contracts.multimodal import MultiModalInput
from asyncengine.worker.mrope_positions import step_positions


class EncoderCache:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                 budget_tokens: int = 8192) -> None:
        self.model = model
        self.device, self.dtype = device, dtype
        self.budget_tokens = budget_tokens
        self.outputs: OrderedDict[str, torch.Tensor] = OrderedDict()  # hash -> [tokens, hidden]
        self.users: dict[str, set[str]] = {}  # hash -> requests that still need it
        self.inputs: dict[str, list[MultiModalInput]] = {}  # req_id -> its images
        self.num_encoded = 0  # images run through the encoder (tests, stats)
        self.num_encoded_rows = 0  # their output rows, and the most one step encoded: the scheduler's
        self.max_step_rows = 0  # encoder budget bounds these (core/encoder_budget.py)

    @classmethod
    def for_model(cls, model, device, dtype, budget_tokens: int = 8192) -> "EncoderCache | None":
        return cls(model, device, dtype, budget_tokens) if getattr(model, "is_multimodal", False) else None

    def add(self, req_id: str, mm_inputs: list[MultiModalInput] | None, num_computed: int) -> None:
        if not mm_inputs:
            return
        self.inputs[req_id] = mm_inputs
        for m in mm_inputs:
            if m.end > num_computed:  # a prefix hit past its run: never needed
                self.users.setdefault(m.hash, set()).add(req_id)

    def reset(self) -> None:
        """Forget every request (the core abandoned them all); outputs stay, for reuse."""
        self.inputs.clear()
        self.users.clear()

    def forget(self, req_id: str) -> None:
        """Release a finished or preempted request's images; what that frees is evicted at the next
        step's start, after the step's new requests are added (one may need the same image: the
        scheduler counted it as held, core/encoder_budget.py)."""
        for m in self.inputs.pop(req_id, ()):
            self._release(m.hash, req_id)

    def _release(self, h: str, req_id: str) -> None:
        users = self.users.get(h)
        if users is not None:
            users.discard(req_id)
            if not users:
                del self.users[h]

    def _evict(self) -> None:
        total = sum(t.shape[0] for t in self.outputs.values())
        for h in list(self.outputs):
            if total <= self.budget_tokens:
                break
            if h not in self.users:
                total -= self.outputs.pop(h).shape[0]

    def step_embeds(self, req_ids: list[str], seqs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat rows, feature rows) for this step's placeholder rows, or None when it has none.
        ``req_ids[i]``'s tokens are ``seqs[i]`` (a SeqChunk: query_start, query_len, context_len)."""
        self._evict()
        spans = []  # (first flat row, image, first row of its output, rows)
        for rid, seq in zip(req_ids, seqs):
            for m in self.inputs.get(rid, ()):
                start, stop = seq.context_len, seq.context_len + seq.query_len
                lo, hi = max(start, m.offset), min(stop, m.end)
                if lo < hi:
                    spans.append((rid, seq.query_start + lo - start, m, lo - m.offset, hi - lo))
        if not spans:
            return None
        self._encode([m for _, _, m, _, _ in spans if m.hash not in self.outputs])
        rows, feats = [], []
        for rid, row, m, first, n in spans:
            self.outputs.move_to_end(m.hash)
            rows.append(torch.arange(row, row + n))
            feats.append(self.outputs[m.hash][first:first + n])
        for rid, row, m, first, n in spans:
            if first + n == m.length:  # this request is past the image's run
                self._release(m.hash, rid)
        self._evict()
        return torch.cat(rows).to(self.device), torch.cat(feats)

    def positions(self, req_ids: list[str], seqs) -> torch.Tensor | None:
        """M-RoPE models: the step's [3, rows] positions from its requests' images (None: none has one)."""
        return step_positions(req_ids, seqs, self.inputs, self.device)

    def _encode(self, todo: list[MultiModalInput]) -> None:
        """Encode the images not yet cached, one batch per pixel shape, once per hash."""
        by_shape: dict[tuple | str, dict[str, MultiModalInput]] = {}
        for m in todo:
            by_shape.setdefault("grid" if m.grid_thw else tuple(m.shape), {})[m.hash] = m
        rows = sum(m.length for group in by_shape.values() for m in group.values())
        self.num_encoded_rows += rows
        self.max_step_rows = max(self.max_step_rows, rows)
        for shape, group in by_shape.items():
            if shape == "grid":
                self._encode_grids(list(group.values()))
                continue
            px = torch.stack([torch.frombuffer(bytearray(m.data), dtype=torch.float32).view(shape)
                              for m in group.values()]).to(self.device, self.dtype)
            out = self.model.encode_images(px)
            for i, h in enumerate(group):
                self.outputs[h] = out[i]
            self.num_encoded += len(group)

    def _encode_grids(self, todo: list[MultiModalInput]) -> None:
        """Dynamic-resolution images (Qwen2-VL): their flattened patches in one call with their
        grids (the tower keeps each image's attention within the image); output split per image."""
        px = torch.cat([torch.frombuffer(bytearray(m.data), dtype=torch.float32).view(m.shape) for m in todo])
        grids = torch.tensor([m.grid_thw for m in todo], dtype=torch.long, device=self.device)
        out = self.model.encode_images(px.to(self.device, self.dtype), grids)
        for m, rows in zip(todo, out.split([m.length for m in todo])):
            self.outputs[m.hash] = rows
        self.num_encoded += len(todo)
