"""The scheduler's view of the host pool: which block hash sits in which slot, in LRU order, and
which slots must not be reused yet (pinned by a load planned this step, by a disk read in flight,
or by a request waiting to load what was staged for it). It holds no bytes: the worker's
:class:`~asyncengine.kv_connector.offload.host_pool.HostPool` does, slot for slot."""
from __future__ import annotations

from collections import OrderedDict


class HostIndex:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # valid entries, least recent first
        self._pending: dict[bytes, int] = {}  # being read from disk: not loadable yet
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}  # slot -> pin count
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._lru.get(block_hash)

    def touch(self, block_hash: bytes) -> None:
        self._lru.move_to_end(block_hash)

    def is_pending(self, block_hash: bytes) -> bool:
        return block_hash in self._pending

    def allocate(self, block_hash: bytes, pending: bool = False) -> int | None:
        """A slot for ``block_hash``: a free one, else the least recently used unpinned entry's.
        ``pending``: its bytes arrive later (``commit`` or ``discard``). None: every slot is pinned."""
        assert block_hash not in self._lru and block_hash not in self._pending
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._lru.items() if s not in self._pins), None)
            if victim is None:
                return None
            slot = self._lru.pop(victim)
            self.num_evictions += 1
        if pending:
            self._pending[block_hash] = slot
        else:
            self._lru[block_hash] = slot
        return slot

    def commit(self, block_hash: bytes) -> None:
        self._lru[block_hash] = self._pending.pop(block_hash)

    def discard(self, block_hash: bytes) -> None:
        """A pending read failed: the slot is free again."""
        self._free.append(self._pending.pop(block_hash))

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        n = self._pins[slot] - 1
        if n:
            self._pins[slot] = n
        else:
            del self._pins[slot]

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def check_invariants(self) -> None:
        """For tests: every slot is exactly one of free, valid or pending."""
        used = list(self._lru.values()) + list(self._pending.values()) + self._free
        assert sorted(used) == list(range(self.num_slots)), "host slots lost or doubled"
