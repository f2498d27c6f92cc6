"""tests/ mirrors the package: no test file sits flat in tests/, basenames are unique (pytest's
default import mode puts each folder on sys.path, so two equal names would collide), and a test
module imports another test module only from its own folder (anything shared lives in the helpers
at tests/: model_utils.py, proc_utils.py, ...), so every file runs alone as well as in the suite."""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_no_flat_test_files_and_unique_names():
    files = _test_files()
    assert len(files) > 40  # the walk sees the suite
    assert [f.name for f in files if f.parent == TESTS] == []
    assert [n for n, c in Counter(f.name for f in files).items() if c > 1] == []


def test_test_modules_import_test_modules_of_their_own_folder_only():
    names = {f.stem: f.parent for f in _test_files()}
    crossing = []
    for f in _test_files():
        for node in ast.walk(ast.parse(f.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            crossing += [f"{f.relative_to(TESTS)} imports {m}" for m in mods if m in names and names[m] != f.parent]
    assert crossing == []
