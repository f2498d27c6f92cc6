"""A grammar that starts after a reasoning span (vLLM's "structured outputs after reasoning"): a
reasoning model thinks freely until it writes the end of its span (``after``: e.g. the ``</think>``
token), and only then is its output held to the request's grammar. With a ``budget``, a span that
reaches that many tokens is closed by forcing the end marker (a reasoning budget, as
``max_reasoning_tokens``). Same interface as structured/backend.py's Matcher, so the runner's
masks, accepts and speculative rollbacks treat both alike."""
from __future__ import annotations

import torch


def _bit(token: int) -> int:
    """The int32 word value with only ``token``'s bit set (bit 31 is the sign bit)."""
    v = 1 << (token % 32)
    return v - (1 << 32) if v >= 1 << 31 else v


class GatedMatcher:
    __slots__ = ("inner", "after", "budget", "before", "opened", "after_n")

    def __init__(self, inner, after: list[int], budget: int | None = None) -> None:
        self.inner = inner  # the grammar's Matcher, or None (a budget alone)
        self.after = tuple(after)
        self.budget = budget
        self.before: list[int] = []  # the tokens of the span, its end marker included
        self.opened = False
        self.after_n = 0  # tokens accepted since the grammar opened

    def _written(self) -> int:
        """How much of the end marker the span already ends with."""
        for k in range(min(len(self.after) - 1, len(self.before)), 0, -1):
            if tuple(self.before[-k:]) == self.after[:k]:
                return k
        return 0

    def forced(self) -> int | None:
        """The next token of the end marker once the budget is spent, else None."""
        if self.opened or self.budget is None:
            return None
        k = self._written()
        return self.after[k] if len(self.before) - k >= self.budget else None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.opened:
            if self.inner is None:
                bitmask[row] = -1
            else:
                self.inner.fill(bitmask, row)
            return
        token = self.forced()
        if token is None:
            bitmask[row] = -1  # reasoning: any token
            return
        bitmask[row] = 0
        bitmask[row, token // 32] = _bit(token)

    def accept(self, token: int) -> bool:
        if self.opened:
            ok = True if self.inner is None else self.inner.accept(token)
            self.after_n += ok
            return ok
        self.before.append(token)
        if len(self.before) >= len(self.after) and tuple(self.before[-len(self.after):]) == self.after:
            self.opened = True
        return True

    def rollback(self, n: int) -> None:
        for _ in range(n):
            if self.opened and self.after_n:
                if self.inner is not None:
                    self.inner.rollback(1)
                self.after_n -= 1
            else:
                self.opened = False
                self.before.pop()

    @property
    def terminated(self) -> bool:
        return self.opened and self.inner is not None and self.inner.terminated
