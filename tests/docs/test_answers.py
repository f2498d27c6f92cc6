"""The docs test's judge of answers (tests/docs/answers.py) tells gibberish and loops from answers."""
from __future__ import annotations

from answers import degenerate


def test_sensible_answers_pass():
    assert degenerate("Why did the scarecrow win an award? Because he was outstanding in his field!") is None
    assert degenerate('{"capital": "Paris"}\n[5, 6, 7] stop') is None
    assert degenerate("") is None
    assert degenerate("one two three, one two three, one two three") is None  # short repeats are words


def test_gibberish_and_loops_fail():
    assert "ASCII" in degenerate("Éléments à Noël ést là çà ôù ïë ñ ü ö ä ß œ æ ø å é è ê ë")
    assert "words" in degenerate("!!! ?? ... ,,, ;; -- ** !! ?? .. ,, x")
    loop = "I am a small model and I like to say this sentence again. " * 6
    assert "loops" in degenerate("Here is a joke. " + loop)
