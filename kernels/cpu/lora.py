"""The grouped LoRA products of lora.c from Python: the structs the C side reads (lora.h) and one
step's rows grouped by adapter slot.

The native decode step (step.c) calls lora.c itself. This binding serves the per-op model's hooks
on CPU fp32 (lora/hooks.py): with torch ops, each adapter of each projection cost a slice, two
small matmuls and a scatter (~55 us of dispatch apiece: 16 rows over 4 adapters decoded at 1.40x
the base step on the bench model); here a projection is one call over every adapter's rows."""
from __future__ import annotations

import ctypes

import torch

from asyncengine.kernels.cpu.build import LazyBinding, load

ptr, c_int, c_long = ctypes.c_void_p, ctypes.c_int, ctypes.c_long


class LoRAProj(ctypes.Structure):  # ae_lora_proj: one fused projection's slot stacks
    _fields_ = [("a", ptr), ("bt", ptr), ("rank", ptr)]


class StepLoRA(ctypes.Structure):  # ae_step_lora: the stacks of every projection, a slot per row
    _fields_ = [("proj", ptr), ("row_slot", ptr), ("num_slots", ctypes.c_int32), ("max_rank", ctypes.c_int32)]


class _Groups(ctypes.Structure):  # ae_lora_groups
    _fields_ = [("order", ptr), ("start", ptr), ("tmp", ptr), ("num_slots", ctypes.c_int32),
                ("max_rank", ctypes.c_int32), ("T", ctypes.c_int32)]


_binding = LazyBinding({
    "ae_lora_groups_free": [ptr],
    "ae_lora_apply": [ptr, ptr, ptr, c_long, c_long, ptr, c_long, ptr, c_int, c_int],
})


def available() -> bool:
    return _binding.available()


def proj_table(slot_layers) -> ctypes.Array:
    """The C table of the layers' stacks (lora/slots.py ``LinearSlots``: a, bt, rank), in order. The
    stacks are filled in place, never reallocated, so the table stays valid for the model's life."""
    return (LoRAProj * len(slot_layers))(*[LoRAProj(ls.a.data_ptr(), ls.bt.data_ptr(), ls.rank.data_ptr())
                                           for ls in slot_layers])


class StepGroups:
    """One step's rows grouped by slot (ae_lora_groups), shared by every projection of the step."""

    def __init__(self, table: ctypes.Array, row_slots: torch.Tensor, num_slots: int, max_rank: int) -> None:
        fns = _binding()
        self._fns, self._table = fns, table
        self._rows = row_slots.to(torch.int32).contiguous()  # int32 [T], -1 = base
        self.num_rows = self._rows.numel()
        step = StepLoRA(ctypes.addressof(table), self._rows.data_ptr(), num_slots, max_rank)
        self._groups = _Groups()
        init = _init_fn()
        rc = init(ctypes.byref(self._groups), ctypes.byref(step), self._rows.numel())
        if rc:
            raise MemoryError("LoRA row groups: out of memory") if rc == -2 else \
                ValueError("LoRA row groups: a row's slot is out of range")
        self._live = True

    def apply(self, index: int, x: torch.Tensor, y: torch.Tensor, parts: list[int]) -> None:
        """``y[rows of slot s] += (x[rows] A_s^T) B_s^T`` for projection ``index`` of the table, in
        place; x [T, K] and y [T, N] fp32 with unit column stride."""
        widths = (c_long * len(parts))(*parts)
        self._fns["ae_lora_apply"](ctypes.addressof(self._table[index]), ctypes.byref(self._groups), x.data_ptr(),
                                   x.stride(0), x.shape[1], y.data_ptr(), y.stride(0), widths, len(parts),
                                   torch.get_num_threads())

    def __del__(self) -> None:
        if getattr(self, "_live", False):
            self._fns["ae_lora_groups_free"](ctypes.byref(self._groups))
            self._live = False


_init = None


def _init_fn():
    """ae_lora_groups_init returns an int (LazyBinding binds functions returning nothing)."""
    global _init
    if _init is None:
        fn = load().ae_lora_groups_init
        fn.argtypes, fn.restype = [ptr, ptr, c_int], c_int
        _init = fn
    return _init
