"""Is a doc example's answer sensible, as a reader would judge it at a glance? Not degenerate:
no loop (the chat command's repeat guard, cli/repetition.py, over its words, does not fire) and
mostly the prompt's language (the docs' prompts are English: mostly ASCII letters, mostly words)."""
from __future__ import annotations

import re

from asyncengine.cli.repetition import RepetitionGuard

MIN_ASCII_LETTERS = 0.9  # of all letters
MIN_WORDS = 0.6  # of whitespace-separated pieces: ones holding an ASCII letter or digit
LOOP_REPEATS = 3  # one span of words three times in a row ...
LOOP_MIN_WORDS = 24  # ... covering at least this many words


def degenerate(text: str) -> str | None:
    """Why ``text`` (what an example printed) is not a sensible answer; None when it is."""
    pieces = text.split()
    if not pieces:
        return None
    letters = [c for c in text if c.isalpha()]
    if letters:
        ascii_share = sum(c.isascii() for c in letters) / len(letters)
        if ascii_share < MIN_ASCII_LETTERS:
            return f"only {ascii_share:.0%} of its letters are ASCII (an English prompt)"
    words = sum(bool(re.search(r"[A-Za-z0-9]", p)) for p in pieces)
    if words / len(pieces) < MIN_WORDS:
        return f"only {words}/{len(pieces)} of its pieces are words"
    ids: dict[str, int] = {}
    guard = RepetitionGuard(LOOP_REPEATS, min_tokens=LOOP_MIN_WORDS)
    if guard.feed(ids.setdefault(re.sub(r"\W", "", p.lower()), len(ids)) for p in pieces):
        return f"it loops: a span of {guard.period} words repeated {LOOP_REPEATS} times"
    return None
