"""Every import of the package's own code inside a function says why it is there: an in-function
import hides a dependency from the reader and costs a lookup per call, so it is kept only for a
reason (start-up cost, torch kept out of the front end, an optional dependency, a cycle) written
next to it as ``# lazy: <reason>`` (on any line of the import statement). Anything else goes to
the module's top.

Read from the source (``ast``) over the same modules as the floors' test (kernels/ and
integrations/ under their package names)."""
from __future__ import annotations

import ast
import textwrap

from test_import_layers import ROOT, _modules


def _own(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "asyncengine"
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "asyncengine" for a in node.names)


def unexplained_lazy_imports(source: str) -> list[int]:
    """Line numbers of in-function imports of asyncengine code with no ``# lazy:`` comment."""
    lines = source.splitlines()
    bad = set()
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if _own(node) and not any("# lazy:" in s for s in lines[node.lineno - 1:node.end_lineno]):
                    bad.add(node.lineno)
    return sorted(bad)


def test_every_in_function_import_says_why():
    found = []
    for _, path in sorted(_modules().items()):
        found += [f"{path.relative_to(ROOT)}:{n}" for n in unexplained_lazy_imports(path.read_text())]
    assert not found, ("in-function asyncengine imports without a `# lazy: <reason>` comment (move each to the "
                       "module's top, or say why it cannot be there):\n" + "\n".join(found))


def test_the_check_sees_an_unexplained_import_and_accepts_an_explained_one():
    src = textwrap.dedent("""
        import asyncengine.errors

        def f():
            from asyncengine.config import EngineConfig
            from asyncengine.engine import (  # lazy: the front end only when asked
                llm)
            from . import sibling
            import json
    """)
    assert unexplained_lazy_imports(src) == [5, 8]
