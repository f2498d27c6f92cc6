"""The state slots of a hybrid model's Mamba layers, runner side: per Mamba layer a conv-window
tensor ``[slots, conv_dim, K-1]`` (the model's dtype) and an SSM-state tensor ``[slots, heads,
head_dim, d_state]`` (fp32: it integrates the whole sequence, as the reference keeps it), and the
per-step :class:`~asyncengine.layers.mamba2.SSMStepMeta` that tells each layer which slot every
request's rows use. The scheduler decides the slots (core/state_slots.py); a request's first chunk
(position 0) starts from zeros whatever its slot held before."""
from __future__ import annotations

import torch

from asyncengine.layers.mamba2 import SSMStepMeta


class StateCache:
    def __init__(self, model, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        s = model.mamba
        self.num_slots = num_slots
        self.device = device
        self.states = [(torch.zeros(s.conv_state_shape(num_slots), dtype=dtype, device=device),
                        torch.zeros(s.ssm_state_shape(num_slots), dtype=torch.float32, device=device))
                       for _ in range(model.num_state_layers)]

    @classmethod
    def for_model(cls, model, num_slots: int, dtype: torch.dtype, device: torch.device) -> "StateCache | None":
        """The cache a model with Mamba layers needs; None for a pure attention model."""
        if not getattr(model, "num_state_layers", 0):
            return None
        return cls(model, num_slots, dtype, device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.states for t in pair)

    def step_meta(self, decode_slots: list[int], prefills: list[tuple[int, int, int, bool]]) -> SSMStepMeta:
        """``decode_slots``: the slots of the step's first rows, one decode each; ``prefills``:
        ``(first row, rows, slot, starts at position 0)`` per prefill chunk."""
        for _, _, slot, _ in prefills:
            assert 0 <= slot < self.num_slots, f"state slot {slot} outside 0..{self.num_slots - 1}"
        slots = torch.tensor(decode_slots, dtype=torch.long, device=self.device)
        run = order = None
        if decode_slots:
            # the decodes' slots as one range (in any row order: slots are handed out lowest first,
            # so a batch admitted together usually holds one): the Mamba layers then update the
            # states in place and permute the small per-row inputs instead of the large states
            first, n = min(decode_slots), len(decode_slots)
            if max(decode_slots) == first + n - 1 and len(set(decode_slots)) == n:
                run = (first, first + n)
                if decode_slots != list(range(first, first + n)):
                    order = torch.tensor(sorted(range(n), key=decode_slots.__getitem__), dtype=torch.long,
                                         device=self.device)
        return SSMStepMeta(num_decodes=len(decode_slots), decode_slots=slots, prefills=prefills, states=self.states,
                           decode_run=run, decode_order=order)

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy every Mamba layer's state from slot ``src`` to slot ``dst`` for each (src, dst)."""
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for conv, ssm in self.states:
            conv[dst] = conv[src]
            ssm[dst] = ssm[src]
