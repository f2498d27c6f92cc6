"""M-RoPE positions (Qwen2-VL): each token has three positions, (temporal, height, width).

A text token has all three equal; an image's placeholder rows sit on their grid: the run starts at
``s`` (the position after the text before it) and the row for (t, r, c) of the merged grid gets
``(s + t, s + r, s + c)``; the text after the image continues from ``s + max(h, w) / merge``
(transformers' ``get_rope_index``; vLLM's ``get_input_positions``). So every token after an image
is shifted by ``max(h, w) / merge - rows``, summed over the images before it: a decode token at
position ``p`` of a request has all three at ``p + delta`` (vLLM's ``mrope_position_delta``).

Everything is a function of the request's images (offset, run length, grid), so nothing is kept
per request: preemption, recompute and prefix-cache hits (a chunk that starts anywhere) need no
state. A step none of whose requests has an image returns None: its three positions are all equal,
and M-RoPE with equal positions is plain RoPE at that position."""
from __future__ import annotations

import torch

from asyncengine.contracts.multimodal import MultiModalInput


def _merge(m: MultiModalInput) -> int:
    """The spatial merge factor: the run has t*h*w / merge**2 rows."""
    t, h, w = m.grid_thw
    return round((t * h * w / m.length) ** 0.5)


def request_positions(images: list[MultiModalInput], start: int, stop: int) -> torch.Tensor:
    """[3, stop - start] M-RoPE positions of one request's tokens ``start..stop-1``."""
    p = torch.arange(start, stop, dtype=torch.long)
    out = p.expand(3, -1).clone()
    shift = 0  # of the tokens after the images so far
    for m in sorted(images, key=lambda m: m.offset):
        merge = _merge(m)
        _, h, w = (x // merge if i else x for i, x in enumerate(m.grid_thw))
        first = m.offset + shift  # the run's start position
        inside = (p >= m.offset) & (p < m.end)
        if bool(inside.any()):
            i = p[inside] - m.offset
            out[0, inside] = first + i // (h * w)
            out[1, inside] = first + (i // w) % h
            out[2, inside] = first + i % w
        shift += max(h, w) - m.length
        out[:, p >= m.end] += max(h, w) - m.length
    return out


def step_positions(req_ids: list[str], seqs, images: dict[str, list[MultiModalInput]],
                   device: torch.device) -> torch.Tensor | None:
    """[3, rows] for a step (``req_ids[i]``'s rows are ``seqs[i]``: query_start, query_len,
    context_len), or None when none of its requests has an image."""
    if not any(images.get(rid) for rid in req_ids):
        return None
    parts = []
    for rid, seq in zip(req_ids, seqs):
        start, stop = seq.context_len, seq.context_len + seq.query_len
        mine = [m for m in images.get(rid, ()) if m.grid_thw]
        parts.append(request_positions(mine, start, stop) if mine
                     else torch.arange(start, stop, dtype=torch.long).expand(3, -1))
    return torch.cat(parts, dim=1).to(device)
