"""The chat command's guard against endless repetition: a small model answering greedily can fall
into a loop ("Once upon a time" ran for over 10 minutes of one repeated sentence), and an answer
that runs "until the model stops" then never stops. :class:`RepetitionGuard` watches the tokens of
one answer and says when its tail is one span repeated ``repeats`` times in a row.

For every period ``L`` up to ``max_period`` it keeps how many tokens in a row, ending at the
newest, equal the token ``L`` before them: ``repeats`` copies of an ``L``-token span at the end is
exactly ``run[L] >= (repeats - 1) * L``. That is ``max_period`` integer updates per token (~20 µs
in Python at 256, against ~25 ms per decoded token), with no re-scan of the answer. A loop must
also cover at least ``min_tokens`` tokens, so short legitimate repeats ("ha ha ha", a three-item
list of one word) do not end an answer.
"""
from __future__ import annotations


class RepetitionGuard:
    def __init__(self, repeats: int, max_period: int = 256, min_tokens: int = 48) -> None:
        if repeats < 2:
            raise ValueError(f"repeats must be >= 2, got {repeats}")
        self.repeats = repeats
        self.max_period = max_period
        self.min_tokens = min_tokens
        self.tokens: list[int] = []
        self.run = [0] * (max_period + 1)  # run[L]: tokens in a row equal to the one L before them
        self.period: int | None = None  # the loop's period once found

    def feed(self, token_ids) -> bool:
        """Add an answer's next tokens; True once its tail is a loop (and from then on)."""
        toks, run = self.tokens, self.run
        for t in token_ids:
            toks.append(t)
            n = len(toks)
            for period in range(1, min(self.max_period, n - 1) + 1):
                run[period] = run[period] + 1 if toks[n - 1 - period] == t else 0
                if self.period is None and run[period] >= max((self.repeats - 1) * period,
                                                              self.min_tokens - period):
                    self.period = period
        return self.period is not None
