"""The host pool's bytes (worker side) and the copies between it and the KV cache.

One tensor ``[num_slots, 2 * num_layers, *block_shape]`` in the cache's dtype: slot ``s`` holds
one block's keys and values of every layer, contiguous, which is also the disk file's payload.
On CPU its memory is reserved, not touched (``kv_cache_zeros``): pages become resident as slots
fill. Copies are batched: one ``index_select`` / ``index_copy_`` per layer and per K/V for all of a
step's blocks.
"""
from __future__ import annotations

import torch

from asyncengine.attention.kv_cache import kv_cache_zeros


def block_dim(backend_name: str) -> int:
    """The dimension of a layer's cache tensor that indexes blocks: the cpu and torch backends are
    head-major ``[heads, blocks, block_size, head_dim]``, triton ``[blocks, block_size, heads, head_dim]``."""
    return 0 if backend_name == "triton" else 1


class HostPool:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], bdim: int, num_slots: int) -> None:
        self.kv_caches = kv_caches
        self.bdim = bdim
        k0 = kv_caches[0][0]
        block_shape = tuple(s for i, s in enumerate(k0.shape) if i != bdim)
        self.num_slots = num_slots
        self.slots = kv_cache_zeros((num_slots, 2 * len(kv_caches), *block_shape), k0.dtype, torch.device("cpu"))
        self.block_nbytes = self.slots[0].numel() * self.slots.element_size()

    def save(self, ops: list[tuple[int, int]]) -> None:
        """(device block, slot) pairs: copy the blocks' K/V of every layer into the slots."""
        dev = self.kv_caches[0][0].device
        blocks = torch.tensor([b for b, _ in ops], dtype=torch.long, device=dev)
        slots = torch.tensor([s for _, s in ops], dtype=torch.long)
        for layer, (k, v) in enumerate(self.kv_caches):
            for j, t in enumerate((k, v)):
                self.slots[slots, 2 * layer + j] = t.index_select(self.bdim, blocks).movedim(self.bdim, 0).cpu()

    def load(self, ops: list[tuple[int, int]]) -> None:
        """(slot, device block) pairs: copy the slots into the blocks."""
        slots = torch.tensor([s for s, _ in ops], dtype=torch.long)
        self.scatter([b for _, b in ops], self.slots[slots])

    def scatter(self, block_ids: list[int], rows: torch.Tensor) -> None:
        """Copy ``rows`` (``[n, 2 * num_layers, *block_shape]``, the slot layout) into the blocks."""
        dev = self.kv_caches[0][0].device
        blocks = torch.tensor(block_ids, dtype=torch.long, device=dev)
        for layer, (k, v) in enumerate(self.kv_caches):
            for j, t in enumerate((k, v)):
                t.index_copy_(self.bdim, blocks, rows[:, 2 * layer + j].to(dev).movedim(0, self.bdim))

    def blocks_bytes(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of device blocks in the slot layout (what a disk file holds): ``[n, block bytes]``
        uint8, one gather per layer and per K/V for all of them."""
        dev = self.kv_caches[0][0].device
        idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
        out = torch.empty((len(block_ids), *self.slots.shape[1:]), dtype=self.slots.dtype)
        for layer, (k, v) in enumerate(self.kv_caches):
            for j, t in enumerate((k, v)):
                out[:, 2 * layer + j] = t.index_select(self.bdim, idx).movedim(self.bdim, 0).cpu()
        return out.view(torch.uint8).reshape(len(block_ids), -1)

    def slot_buffer(self, slot: int):
        """A writable uint8 view of one slot (a disk read lands here)."""
        return self.slots[slot].view(torch.uint8).reshape(-1).numpy()
