"""The compiled-grammar cache: one per process and tokenizer, least recently used first out,
bounded in bytes (not entries: one 10,000-value enum holds ~160 MB inside xgrammar, a small schema
~50 KB, so an entry count bounds nothing).

An entry's size is what it holds: the packed serialized grammar (what cores in other processes receive)
and, once a matcher needed it, the deserialized grammar (xgrammar's own ``memory_size_bytes``).
xgrammar's own compiler cache is off (backend.py), so this is the only place compiled grammars
live between requests.
"""
from __future__ import annotations

import threading
from collections import OrderedDict


class CompiledEntry:
    """One compiled grammar: ``serialized`` (xgrammar's JSON, zlib-packed: compile_worker.pack),
    ``grammar`` (the CompiledGrammar, deserialized when first needed in this process), and
    ``nbytes`` as the cache counts it."""

    __slots__ = ("serialized", "grammar", "nbytes")

    def __init__(self, serialized: bytes | None, grammar=None) -> None:
        self.serialized = serialized
        self.grammar = grammar
        self.nbytes = self.size()

    def size(self) -> int:
        n = len(self.serialized) if self.serialized is not None else 0
        if self.grammar is not None:
            n += int(self.grammar.memory_size_bytes)
        return n


class GrammarCache:
    """A thread-safe LRU of :class:`CompiledEntry` by key, holding at most ``max_bytes`` (an entry
    larger than that is not kept at all). ``nbytes`` is the sum of the entries' sizes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.evictions = 0
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key) -> CompiledEntry | None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                self._entries.move_to_end(key)
            return e

    def put(self, key, entry: CompiledEntry) -> CompiledEntry:
        """Store ``entry`` (replacing one of the same key) and evict the least recently used until
        the cache fits. Returns ``entry`` (usable even when it was too large to keep)."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            entry.nbytes = entry.size()
            if entry.nbytes <= self.max_bytes:
                self._entries[key] = entry
                self.nbytes += entry.nbytes
            self._shrink()
        return entry

    def resized(self, key, entry: CompiledEntry) -> None:
        """``entry`` gained its deserialized grammar: count its new size (it may evict others, or
        itself when it no longer fits)."""
        with self._lock:
            if self._entries.get(key) is not entry:
                return
            new = entry.size()
            self.nbytes += new - entry.nbytes
            entry.nbytes = new
            if new > self.max_bytes:
                del self._entries[key]
                self.nbytes -= new
            self._shrink()

    def _shrink(self) -> None:
        while self.nbytes > self.max_bytes and self._entries:
            _, e = self._entries.popitem(last=False)
            self.nbytes -= e.nbytes
            self.evictions += 1

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                    "evictions": self.evictions}
