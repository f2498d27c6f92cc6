"""State slots: the cache group of state-space (Mamba) layers, scheduler side.

A Mamba layer keeps a fixed-size state per request (its conv window and SSM state) instead of KV
blocks that grow with the context. The scheduler hands each running request one slot index; the
runner's tensors hold, per Mamba layer, one state per slot (worker/state_cache.py). A slot is
taken when a request is first scheduled and given back when it finishes, is aborted or is
preempted (a preempted request recomputes its state from its tokens, like its KV). There are as
many slots as ``max_num_seqs``, so a slot never stops a request that the sequence limit admits.
"""
from __future__ import annotations


class StateSlotPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state slot pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: the lowest index is reused first
        self._owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_slots

    def slot_of(self, request_id: str) -> int:
        """The request's slot, or -1 when it holds none."""
        return self._owner.get(request_id, -1)

    def allocate(self, request_id: str) -> int | None:
        """The request's slot (a new one if it had none); None when every slot is taken."""
        slot = self._owner.get(request_id)
        if slot is not None:
            return slot
        if not self._free:
            return None
        slot = self._owner[request_id] = self._free.pop()
        return slot

    def free(self, request_id: str) -> None:
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
