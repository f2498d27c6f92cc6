"""The grouped low-rank apply (punica's SGMV idea on plain torch): per step and per linear layer, one
pair of matmuls over all the rows of each adapter, never one per request. Base-model rows (slot -1)
are not touched, so a step without adapters costs nothing and stays token-exact."""
from __future__ import annotations

import torch


def row_groups(row_slots: torch.Tensor) -> list[tuple[int, torch.Tensor | slice]]:
    """(slot, rows) per adapter slot present in ``row_slots`` (a step's slot per token row, -1 =
    base). Computed once per step and shared by every layer: contiguous runs become slices (no
    gather), else an index tensor."""
    groups: list[tuple[int, torch.Tensor | slice]] = []
    if row_slots.numel() == 0:
        return groups
    slots = row_slots.tolist()
    for slot in sorted(set(slots) - {-1}):
        rows = [i for i, s in enumerate(slots) if s == slot]
        if rows[-1] - rows[0] + 1 == len(rows):
            groups.append((slot, slice(rows[0], rows[-1] + 1)))
        else:
            groups.append((slot, torch.tensor(rows, dtype=torch.long, device=row_slots.device)))
    return groups


def add_lora(y: torch.Tensor, x: torch.Tensor, groups: list[tuple[int, torch.Tensor | slice]],
             a_stack: torch.Tensor, b_stack: torch.Tensor) -> torch.Tensor:
    """``y[rows] += (x[rows] @ A[slot]^T) @ B[slot]^T`` for each group, in place.

    a_stack: [slots, R, in]; b_stack: [slots, out, R] (scale folded in; unused rank columns zero),
    R the stacked rank (fused layers stack their parts' ranks side by side)."""
    for slot, rows in groups:
        a, b = a_stack[slot], b_stack[slot]
        xs = x[rows]
        delta = (xs @ a.t().to(xs.dtype)) @ b.t().to(xs.dtype)
        if isinstance(rows, slice):
            y[rows] += delta
        else:
            y.index_add_(0, rows, delta)
    return y
