"""Stop strings, checked on the streamed text.

No part of a stop string is ever streamed (unless ``include_stop_str_in_output``): text that could
be the beginning of a stop string is held back, and only as much as needed: the longest suffix of
the pending text that is a prefix of some stop string. Held-back text is released as soon as it
can no longer start a stop string, or by :meth:`StopStringMatcher.flush` when the request ends for
another reason (EOS, stop token, max_tokens, abort).

Which stop wins when several occur: the one that is complete first in the stream (the smallest end
position); among stops ending at the same position, the longest (it starts earliest). This does
not depend on how the text is split into deltas. The output is the text before it (or up to and
including it, with ``include_stop_str_in_output``).
"""
from __future__ import annotations

from typing import Iterable

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    """Feed it the text deltas of one sequence; it returns what may be streamed.

    >>> m = StopStringMatcher(["###"], include_stop_str_in_output=False)
    >>> m.feed("Hello #")
    ('Hello ', None)
    >>> m.feed("# world ##")
    ('## world ', None)
    >>> m.feed("# tail")
    ('', '###')
    """

    __slots__ = ("stops", "include_stop_str_in_output", "_pending", "_prefixes", "_max_hold",
                 "stopped", "matched")

    def __init__(self, stops: Iterable[str] | None, include_stop_str_in_output: bool = False
                 ) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in (stops or ()) if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        self._pending = ""  # see feed()
        # proper prefixes of the stops: what a held-back suffix may be
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self.stops), default=0)
        self.stopped = False
        self.matched: str | None = None

    @property
    def held_back(self) -> str:
        """The text currently held back (a possible beginning of a stop string)."""
        return "" if self.include_stop_str_in_output else self._pending

    def feed(self, delta_text: str) -> tuple[str, str | None]:
        """Add new text; return ``(text_to_emit, matched_stop_or_None)``.

        Once a stop has matched, the sequence is over: later calls return ``("", None)``.
        """
        if self.stopped:
            return "", None
        if not self.stops:
            return delta_text, None
        if not delta_text:
            return "", None
        # pending: with include_stop_str_in_output, the already emitted tail (kept only to find
        # stops that span deltas); otherwise the held-back text. Neither holds a complete stop.
        text = self._pending + delta_text
        n_old = len(self._pending)
        # the match that ends first: it must end inside the new text
        best_end = -1
        best_start = 0
        best_stop = None
        for s in self.stops:
            i = text.find(s, max(0, n_old - len(s) + 1))
            if i < 0:
                continue
            end = i + len(s)
            if best_stop is None or end < best_end or (end == best_end and i < best_start):
                best_end, best_start, best_stop = end, i, s
        if self.include_stop_str_in_output:
            # everything up to now precedes the end of any future match: emit it all
            if best_stop is not None:
                self._stop(best_stop)
                return text[n_old:best_end], best_stop
            self._pending = text[len(text) - min(self._max_hold, len(text)):] \
                if self._max_hold else ""
            return delta_text, None
        if best_stop is not None:
            self._stop(best_stop)
            return text[:best_start], best_stop
        hold = self._hold_length(text)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], None

    def _stop(self, stop: str) -> None:
        self.stopped = True
        self.matched = stop
        self._pending = ""

    def flush(self) -> str:
        """The request ended for another reason: release the held-back text."""
        out, self._pending = self._pending, ""
        return "" if self.include_stop_str_in_output else out

    def _hold_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        prefixes = self._prefixes
        for k in range(min(self._max_hold, len(text)), 0, -1):
            if text[-k:] in prefixes:
                return k
        return 0
