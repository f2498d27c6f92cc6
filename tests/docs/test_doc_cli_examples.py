"""Every ``asyncengine ...`` command line that README.md and docs/*.md show (inline code and code
blocks) is a valid command line: its command and flags exist and its values parse. Placeholders
are filled in (MODEL, H, P, KEY, N, M, "..."), ``[optional]`` parts are kept, ``a|b`` alternatives
are each tried. A flag named at the end of a span without its value (``asyncengine chat
--prompt``) is a mention of that flag, checked to exist. What they do when run: tests/cli/."""
from __future__ import annotations

import contextlib
import io
import itertools
import re
import shlex

import pytest
from snippets import ROOT, doc_files

from asyncengine.cli import build_parser

PLACEHOLDERS = {"MODEL": "some-model", "H": "127.0.0.1", "P": "8000", "KEY": "secret", "N": "2", "M": "2",
                "...": "some text", '"..."': "some text", "COMMAND": "chat"}
_INLINE = re.compile(r"`(asyncengine (?:[^`])*)`")
_FENCED = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
_LINE = re.compile(r"^\s*(?:\$ )?(?:.*\| )?(asyncengine (?:chat|generate|serve|--)[^\n]*)$", re.M)


def examples() -> list[tuple[str, str]]:
    found = {}
    for path in doc_files():
        text = path.read_text()
        spans = [(m.group(1), m.start()) for m in _INLINE.finditer(text)]
        for block in _FENCED.finditer(text):  # command lines only inside code blocks (not table rows)
            spans += [(m.group(1), block.start(1) + m.start()) for m in _LINE.finditer(block.group(1))]
        for cmd, pos in spans:
            cmd = cmd.strip()
            if "`" not in cmd:
                found.setdefault(cmd, f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, pos) + 1}")
    return sorted((where, cmd) for cmd, where in found.items())


def variants(cmd: str) -> list[list[str]]:
    """The argument lists one documented line stands for."""
    tokens = shlex.split(cmd.replace("[", " ").replace("]", " "))[1:]
    options = []
    for tok in tokens:
        if tok in PLACEHOLDERS:
            options.append([PLACEHOLDERS[tok]])
        elif "/--" in tok:  # "--max-request-bytes/--max-prompt-chars/...": a list of flags
            options.append([f for f in tok.split("/") if f.startswith("--")])
        elif "|" in tok and not tok.startswith("{"):
            options.append(tok.split("|"))
        else:
            options.append([tok])
    return [list(c) for c in itertools.product(*options)]


def _parse(argv: list[str]) -> str | None:
    """None if argparse accepts ``argv`` (or exits 0: --help, --version); else its message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as e:
        return None if e.code == 0 else err.getvalue().strip().splitlines()[-1]
    return None


def _check(argv: list[str]) -> str | None:
    why = _parse(argv)
    if why and "expected one argument" in why and argv[-1].startswith("--"):
        # a flag named without its value: it must exist (with a value it parses)
        return _parse(argv + ["1"]) and _parse(argv + ["some text"])
    if why and "the following arguments are required: --prompt" in why:  # "asyncengine generate --model M"
        return _parse(argv + ["--prompt", "some text"])
    return why


EXAMPLES = examples()


def test_the_docs_show_command_lines():
    assert len(EXAMPLES) >= 10


@pytest.mark.parametrize("where, cmd", EXAMPLES, ids=[f"{w} {c[:60]}" for w, c in EXAMPLES])
def test_command_line_parses(where, cmd):
    for argv in variants(cmd):
        why = _check(argv)
        assert why is None, f"{where}: `{cmd}` -> {argv}: {why}"
