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

Cost: one Aho-Corasick automaton per request (:class:`StopAutomaton`, shared by its ``n``
samples), built in time and memory linear in the total length of the stop strings; each streamed
character then costs amortized O(1), however many and however long the stops are. (An earlier
version kept the set of every prefix of every stop string: quadratic in a stop's length, 2.3 GB
for one 80,000-character stop.)
"""
from __future__ import annotations

from typing import Iterable

__all__ = ["StopAutomaton", "StopStringMatcher"]

_SHIFT = 21  # code points are < 2**21: an edge (node, char) is the int key node << 21 | ord(char)


class StopAutomaton:
    """The Aho-Corasick automaton of a set of stop strings; immutable once built, so the samples
    of one request share it.

    A state is a trie node: the longest suffix of the text read so far that is a prefix of some
    stop string. ``depth[v]`` is its length (what must be held back), ``match[v]`` the longest
    stop string that is a suffix of it (``None`` when there is none).
    """

    __slots__ = ("stops", "max_len", "_goto", "_fail", "depth", "match")

    def __init__(self, stops: Iterable[str] | None) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in (stops or ()) if s))
        self.max_len = max((len(s) for s in self.stops), default=0)
        goto: dict[int, int] = {}
        depth = [0]
        parent = [0]
        label = [0]  # the code point of the edge into each node
        terminal: list[str | None] = [None]
        for s in self.stops:  # the trie: one int-keyed dict entry per edge
            v = 0
            for ch in s:
                c = ord(ch)
                key = v << _SHIFT | c
                nxt = goto.get(key)
                if nxt is None:
                    nxt = len(depth)
                    goto[key] = nxt
                    depth.append(depth[v] + 1)
                    parent.append(v)
                    label.append(c)
                    terminal.append(None)
                v = nxt
            terminal[v] = s
        # failure links, shallowest nodes first (a node's link is shallower than the node)
        fail = [0] * len(depth)
        match: list[str | None] = [None] * len(depth)
        for v in sorted(range(1, len(depth)), key=depth.__getitem__):
            u = parent[v]
            f = 0
            if u:
                key_c = label[v]
                f = fail[u]
                while True:
                    nxt = goto.get(f << _SHIFT | key_c)
                    if nxt is not None:
                        f = nxt
                        break
                    if f == 0:
                        break
                    f = fail[f]
            fail[v] = f
            # the longest stop ending here: this node's own string if it is one (the longest
            # suffix of all), else the longest one of its failure node
            match[v] = terminal[v] if terminal[v] is not None else match[f]
        self._goto, self._fail, self.depth, self.match = goto, fail, depth, match

    def step(self, state: int, ch: str) -> int:
        goto, fail, c = self._goto, self._fail, ord(ch)
        while True:
            nxt = goto.get(state << _SHIFT | c)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]


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

    __slots__ = ("automaton", "include_stop_str_in_output", "_state", "_pending", "stopped", "matched")

    def __init__(self, stops: Iterable[str] | StopAutomaton | None, include_stop_str_in_output: bool = False
                 ) -> None:
        self.automaton = stops if isinstance(stops, StopAutomaton) else StopAutomaton(stops)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._state = 0  # the automaton's state after all text fed so far
        self._pending = ""  # without include_stop_str_in_output: the held-back text
        self.stopped = False
        self.matched: str | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        return self.automaton.stops

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
        a = self.automaton
        if not a.stops:
            return delta_text, None
        if not delta_text:
            return "", None
        state, step, match = self._state, a.step, a.match
        for i, ch in enumerate(delta_text):
            state = step(state, ch)
            stop = match[state]
            if stop is not None:  # the first stop to complete; the longest one ending here
                self.stopped, self.matched = True, stop
                pending, self._pending = self._pending, ""
                if self.include_stop_str_in_output:
                    return delta_text[:i + 1], stop
                text = pending + delta_text[:i + 1]
                return text[:len(text) - len(stop)], stop
        self._state = state
        if self.include_stop_str_in_output:
            return delta_text, None
        # hold back exactly the longest suffix that may still begin a stop: the state's depth
        text = self._pending + delta_text
        hold = a.depth[state]
        self._pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], None

    def flush(self) -> str:
        """The request ended for another reason: release the held-back text."""
        out, self._pending = self._pending, ""
        return "" if self.include_stop_str_in_output else out
