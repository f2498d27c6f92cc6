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


def request_positions(images: list[MultiModalInput], start: int, stop: int) -> list[list[int]]:
    """The (temporal, height, width) position lists of one request's tokens ``start..stop-1``:
    plain Python (a decode row is one append per stream), the tensor made once per step."""
    out: list[list[int]] = [[], [], []]
    p, shift = start, 0  # shift: of the tokens after the images so far

    def text(upto: int) -> int:
        rows = range(p + shift, upto + shift)
        for stream in out:
            stream.extend(rows)
        return upto

    for m in sorted(images, key=lambda m: m.offset):
        if p >= stop:
            return out
        if p < m.offset:  # the text before this image
            p = text(min(stop, m.offset))
        merge = _merge(m)
        gh, gw = m.grid_thw[1] // merge, m.grid_thw[2] // merge
        if m.offset <= p < m.end:  # its placeholder rows: on the merged grid, from the run's start
            first, q = m.offset + shift, min(stop, m.end)
            for i in range(p - m.offset, q - m.offset):
                out[0].append(first + i // (gh * gw))
                out[1].append(first + (i // gw) % gh)
                out[2].append(first + i % gw)
            p = q
        shift += max(gh, gw) - m.length
    if p < stop:
        text(stop)
    return out


def step_positions(req_ids: list[str], seqs, images: dict[str, list[MultiModalInput]],
                   device: torch.device) -> torch.Tensor | None:
    """[3, rows] for a step (``req_ids[i]``'s rows are ``seqs[i]``: query_start, query_len,
    context_len), or None when none of its requests has an image."""
    if not any(images.get(rid) for rid in req_ids):
        return None
    out: list[list[int]] = [[], [], []]
    for rid, seq in zip(req_ids, seqs):
        mine = [m for m in images.get(rid, ()) if m.grid_thw]
        for stream, rows in zip(out, request_positions(mine, seq.context_len, seq.context_len + seq.query_len)):
            stream.extend(rows)
    return torch.tensor(out, dtype=torch.long, device=device)
