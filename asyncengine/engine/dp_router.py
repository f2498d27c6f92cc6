"""Which data-parallel engine core gets a new request: the one that most likely holds its prompt's
prefix in its KV cache, unless that core is much busier than the least loaded one.

Each core has its own prefix cache, so a request sent to the core that served the same system
prompt (or the earlier turns of the same chat) skips recomputing it; sent elsewhere it computes
it again and the cache holds it twice. The router cannot see the cores' caches (they live in other
processes), so it remembers, per core, the chained hashes of the full prompt blocks it sent there
(``max_blocks`` per prompt at most, ``capacity`` per core, oldest forgotten first): an estimate,
since a core may have evicted them since. Prompts shorter than one block, or with no match, go to
the least loaded core (waiting + running); so does a match on a core whose load exceeds the least
loaded one's by more than ``slack`` requests (a queue there would cost more than the prefill
saved).
"""
from __future__ import annotations

from collections import OrderedDict


def prefix_hashes(prompt: list[int], block_size: int, salt: str | None, max_blocks: int) -> list[int]:
    """Chained hashes of the prompt's first full blocks: the k-th stands for blocks 0..k together."""
    out: list[int] = []
    h = hash(("asyncengine-dp", salt))
    for k in range(min(len(prompt) // block_size, max_blocks)):
        h = hash((h, tuple(prompt[k * block_size:(k + 1) * block_size])))
        out.append(h)
    return out


class PrefixAffinityRouter:
    def __init__(self, num_cores: int, block_size: int, slack: int, max_blocks: int = 64,
                 capacity: int = 1 << 16) -> None:
        self.block_size = block_size
        self.slack = slack
        self.max_blocks = max_blocks
        self.capacity = capacity
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_cores)]
        self.num_affinity_routed = 0  # requests sent to a core other than the least loaded for a prefix

    def pick(self, prompt: list[int], salt: str | None, loads: list[int]) -> int:
        hashes = prefix_hashes(prompt, self.block_size, salt, self.max_blocks)
        least = min(range(len(loads)), key=lambda k: (loads[k], k))
        best, best_len = least, 0
        for k, seen in enumerate(self.seen):
            n = 0
            for h in hashes:  # chained: the matched blocks are a prefix of the list
                if h not in seen:
                    break
                n += 1
            if n > best_len or (n == best_len and n and loads[k] < loads[best]):
                best, best_len = k, n
        if best_len == 0 or loads[best] > loads[least] + self.slack:
            best = least
        elif best != least:
            self.num_affinity_routed += 1
        seen = self.seen[best]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
        return best
