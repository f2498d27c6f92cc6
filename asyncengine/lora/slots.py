"""Where adapters live: up to ``max_cpu_loras`` in host memory (least recently used out first) and
up to ``max_loras`` in device slots, stacked per linear layer and sized once for ``max_lora_rank`` so
that loading an adapter into a slot is a copy, never an allocation.

A fused layer (q/k/v in one ``qkv_proj``, gate/up in one ``gate_up_proj``) gets one stack whose rank
axis holds each part's rank block side by side and whose B is block-diagonal over the output
columns: one pair of matmuls per adapter per fused layer. Beside B, ``bt`` holds those diagonal
blocks transposed ([slots, max_rank, out]: part p's block in p's own columns), the layout the
native decode step's C loop reads (kernels/cpu/lora.c), and ``rank`` each slot's rank there. The
C step keeps pointers into these stacks, so they are filled in place, never reallocated."""
from __future__ import annotations

from collections import OrderedDict

import torch

from asyncengine.errors import ConfigError
from asyncengine.lora.peft_adapter import LoRAAdapter


class LinearSlots:
    """One linear layer's stacks: parts = [(peft module name, out columns)] in fused order."""

    def __init__(self, layer: int, parts: list[tuple[str, int]], fan_in: int, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.layer, self.parts, self.max_rank = layer, parts, max_rank
        out = sum(n for _, n in parts)
        width = max_rank * len(parts)
        self.a = torch.zeros(max_loras, width, fan_in, device=device, dtype=dtype)
        self.b = torch.zeros(max_loras, out, width, device=device, dtype=dtype)
        # only the CPU's native step reads it
        self.bt = torch.zeros(max_loras, max_rank, out, dtype=dtype) if torch.device(device).type == "cpu" else None
        self.rank = torch.zeros(max_loras, dtype=torch.int32, device=device)

    def fill(self, slot: int, adapter: LoRAAdapter | None) -> bool:
        """Copy ``adapter``'s parts into ``slot`` (zeros where it has none); True if it has any."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if self.bt is not None:
            self.bt[slot].zero_()
        any_part, col, rank = False, 0, 0
        for i, (module, n) in enumerate(self.parts):
            pair = adapter.weights.get((self.layer, module)) if adapter is not None else None
            if pair is not None:
                a, b = pair
                r0 = i * self.max_rank
                self.a[slot, r0:r0 + a.shape[0]] = a
                self.b[slot, col:col + n, r0:r0 + a.shape[0]] = b
                if self.bt is not None:
                    self.bt[slot, :a.shape[0], col:col + n] = b.t()
                any_part, rank = True, max(rank, a.shape[0])
            col += n
        self.rank[slot] = rank
        return any_part


class LoRASlots:
    """The host LRU and the device slots of every hooked layer (one per model, owned by the worker)."""

    def __init__(self, layers: list[LinearSlots], max_loras: int, max_cpu_loras: int) -> None:
        self.layers, self.max_loras, self.max_cpu_loras = layers, max_loras, max_cpu_loras
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # id -> adapter, oldest first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # resident id -> slot, least recent first

    def add(self, adapter: LoRAAdapter) -> None:
        """Keep ``adapter`` in host memory; the least recently used one not in a slot leaves first,
        never ``adapter`` itself (its request is about to step): while every other one holds a slot,
        the host keeps one over ``max_cpu_loras`` until a slot frees."""
        self.host[adapter.id] = adapter
        self.host.move_to_end(adapter.id)
        while len(self.host) > self.max_cpu_loras:
            victim = next((i for i in self.host if i not in self.slot_of and i != adapter.id), None)
            if victim is None:
                break
            del self.host[victim]

    def remove(self, lora_id: int) -> None:
        self.host.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            for ls in self.layers:
                ls.fill(slot, None)

    def activate(self, lora_ids: set[int]) -> dict[int, int]:
        """Slots for this step's adapters (at most ``max_loras``), loading the missing ones into the
        least recently used slots not needed by this step."""
        if len(lora_ids) > self.max_loras:
            raise ConfigError(f"a step asked for {len(lora_ids)} LoRA adapters; max_loras is {self.max_loras}")
        missing = [i for i in lora_ids if i not in self.host]
        if missing:
            raise ConfigError(f"LoRA adapter ids {missing} are not loaded")
        for lora_id in lora_ids:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            self._load(lora_id, lora_ids)
        return {i: self.slot_of[i] for i in lora_ids}

    def _load(self, lora_id: int, keep: set[int]) -> None:
        used = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.slot_of if i not in keep)
            slot = self.slot_of.pop(victim)
        adapter = self.host[lora_id]
        for ls in self.layers:
            ls.fill(slot, adapter)
        self.slot_of[lora_id] = slot
        self.host.move_to_end(lora_id)
