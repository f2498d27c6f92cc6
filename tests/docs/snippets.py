"""The Python code blocks of README.md and docs/*.md, as the docs test runs them.

A block is runnable as written unless the line right above it is a marker:

* ``<!-- fragment: why -->``: a fragment (e.g. the choices of a field), only compiled;
* ``<!-- snippet: needs a server on 127.0.0.1:8000 -->``: runs while ``asyncengine serve`` runs
  (the test starts one on a free port and puts its port in place of 8000).
* ``<!-- snippet: answer not checked (why) -->``: runs, but what it prints is not judged as an
  answer (tests/docs/answers.py), e.g. a random-weight model's tokens.

Blocks inside list items (indented) are dedented first.
"""
from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER_ADDRESS = "127.0.0.1:8000"
_BLOCK = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
_MARKER = re.compile(r"<!--\s*(?P<kind>fragment|snippet)\s*:\s*(?P<what>.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Snippet:
    where: str  # "README.md:95"
    code: str
    fragment: str | None  # why it is only compiled
    needs_server: bool
    check_answer: bool  # what it prints must pass answers.degenerate


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def snippets() -> list[Snippet]:
    found = []
    for path in doc_files():
        text = path.read_text()
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = _MARKER.search(before)
            kind = marker.group("kind") if marker else None
            what = marker.group("what") if marker else ""
            found.append(Snippet(where=f"{path.relative_to(ROOT)}:{line}", code=textwrap.dedent(m.group("code")),
                                 fragment=what if kind == "fragment" else None,
                                 needs_server=kind == "snippet" and "server" in what,
                                 check_answer=not (kind == "snippet" and "answer not checked" in what)))
    return found
