"""The block pool: every KV block the engine owns, their reference counts, the free queue and the
prefix-cache index.

All blocks are created once. A block is *free* when no request references it (ref_cnt == 0); a
free block may still hold a cached prefix (``block_hash`` set) and is then reusable by a prefix hit
until allocation evicts it. The free queue is LRU: ``free`` appends at the tail, allocation pops
the head, so the least recently freed cached block is evicted first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence


class KVBlock:
    """One block of ``block_size`` token slots in every layer's KV cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks: O(1) pop, append and removal from the
    middle (a prefix hit on a free cached block takes it out of the queue)."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVBlock:
        b = self._head.next_free
        if b is self._tail:
            raise IndexError("no free blocks")
        self.remove(b)
        return b

    def remove(self, b: KVBlock) -> None:
        assert b.prev_free is not None and b.next_free is not None, f"{b} is not in the free queue"
        b.prev_free.next_free = b.next_free
        b.next_free.prev_free = b.prev_free
        b.prev_free = b.next_free = None
        self.num_free -= 1

    def append(self, b: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = b
        b.prev_free = last
        b.next_free = self._tail
        self._tail.prev_free = b
        self.num_free += 1

    def __iter__(self):
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: str | None = None) -> bytes:
    """Chained block hash: sha256(parent hash, the block's token ids, extra keys such as a cache salt).

    The full 256-bit sha256 rather than Python's ``hash()``: a collision would silently serve another
    prompt's KV, ``hash()`` collisions can be crafted, and sha256 ones cannot (128-bit resistance
    even against an adversary), while comparing stored token ids on every hit would cost a copy
    per block. About a microsecond per block, nothing next to a forward pass.
    """
    h = hashlib.sha256()
    if parent is not None:
        h.update(parent)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\x00salt:" + extra.encode())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0
        # called with (block, hash) when allocation evicts a cached block (a KV connector saves it)
        self.on_evict = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:  # evict the cached prefix it held
                if self.on_evict is not None:
                    self.on_evict(b, b.block_hash)
                del self.cached[b.block_hash]
                b.block_hash = None
                self.num_evictions += 1
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (they may be sitting free)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each; blocks reaching zero join the free queue's tail in the
        order given (callers pass a request's blocks tail-first so its deepest blocks go first)."""
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"double free of {b}"
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def cache_block(self, b: KVBlock, block_hash: bytes) -> None:
        """Register a full, computed block under its hash. A block whose content is already cached
        under another block stays unregistered (its twin serves future hits)."""
        if not self.enable_caching or b.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        b.block_hash = block_hash
        self.cached[block_hash] = b

    def uncache_block(self, b: KVBlock) -> None:
        """Take a block out of the prefix cache (it was registered for a step that will not write it)."""
        if b.block_hash is not None:
            del self.cached[b.block_hash]
            b.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no request holds a block."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in self.cached.values():
            b.block_hash = None
        self.cached.clear()
        return True

    def check_invariants(self) -> None:
        """For tests: the free queue holds exactly the unreferenced blocks, the hash map only blocks
        that carry that hash."""
        in_queue = list(self.free_queue)
        assert len(in_queue) == self.num_free_blocks == len(set(map(id, in_queue)))
        assert all(b.ref_cnt == 0 for b in in_queue)
        assert sum(1 for b in self.blocks if b.ref_cnt == 0) == self.num_free_blocks
        for h, b in self.cached.items():
            assert b.block_hash == h
        assert sum(1 for b in self.blocks if b.block_hash is not None) == len(self.cached)
