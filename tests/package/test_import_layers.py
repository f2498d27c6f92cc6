"""The package's folders are its floors: no import cycle between modules or between folders, and no
module imports a floor above its own folder's. Only folders are listed (no module has a place of
its own), so a line of code can tell from its folder what it may import (docs/architecture.md).

Read from the source (``ast``), not by importing: every ``import`` statement counts, the lazy ones
inside functions and under ``if TYPE_CHECKING:`` too (a lazy upward import is still a dependency
upward; laziness only hides it from the interpreter). ``kernels/`` and ``integrations/`` are mapped
into the package by pyproject's ``package-dir`` and walked under those names. Importing ``a.b.c``
also runs ``a/b/__init__.py``: an edge to ``a.b``, unless that ``__init__`` imports only its own
submodules (a re-export: the edge goes to those) or nothing (names resolved lazily). Imports by
string (``importlib.import_module``: the lazy ``__init__``s and the attention registry's class paths)
are not seen; each of those points down its own package.
"""
from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Floors, top first: a module may import its own floor or any floor below it, never one above, and
# no folder imports a folder that imports it back. Only folders are listed: a module's floor is its
# folder's (``asyncengine.X`` for anything under ``asyncengine/X/``; ``asyncengine`` for the
# package root's own files, the public types). One rule places modules by name, not by folder: a
# ``__main__`` is an entry point wherever it sits (it is what ``python -m`` runs).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry points", ("asyncengine.cli", "asyncengine.integrations")),
    ("front end (imports no torch)", ("asyncengine.engine",)),
    ("engine core and its hosts", ("asyncengine.engine_core",)),
    ("executors", ("asyncengine.executor",)),
    ("worker (model runner, sampler)", ("asyncengine.worker",)),
    # beside the KV-cache manager (scheduler side) and the model runner (worker side)
    ("KV connectors", ("asyncengine.kv_connector",)),
    ("speculative proposers", ("asyncengine.spec_decode",)),
    # models run over the attention backends (a model's native decode step reads the CPU backend's
    # metadata); the backends know no model
    ("models", ("asyncengine.models",)),
    # LoRA adapters hook the models' linear layers by name; they know no model class, no engine
    ("LoRA adapters", ("asyncengine.lora",)),
    ("attention backends", ("asyncengine.attention",)),
    ("layers", ("asyncengine.layers",)),
    ("scheduler and KV-cache manager", ("asyncengine.core",)),
    ("structured outputs", ("asyncengine.structured",)),
    # images to encoder inputs and placeholder tokens (front-end code: no torch)
    ("multimodal input", ("asyncengine.multimodal",)),
    ("contracts: what crosses the executor seam", ("asyncengine.contracts",)),
    ("configuration and the machine", ("asyncengine.config", "asyncengine.platforms")),
    ("kernels", ("asyncengine.kernels",)),  # leaf compute: they know no config, no model
    ("public types and errors (the package root's files)", ("asyncengine",)),
]
ENTRY_POINTS = 0


def _modules(root: Path = ROOT) -> dict[str, Path]:
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped: dict[str, str] = setup["package-dir"]
    mods: dict[str, Path] = {}
    for pkg, folder in mapped.items():
        if pkg.count(".") > 1:  # data-only packages (the web chat page)
            continue
        base = root / folder
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if pkg == "asyncengine" and parts and f"asyncengine.{parts[0]}" in mapped:
                continue
            mods[".".join([pkg, *parts])] = path
    return mods


def _targets(mods: dict[str, Path], importer: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            pkg = importer if mods[importer].name == "__init__.py" else importer.rpartition(".")[0]
            for _ in range(node.level - 1):
                pkg = pkg.rpartition(".")[0]
            base = f"{pkg}.{node.module}" if node.module else pkg
        else:
            base = node.module or ""
        names = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
    out = []
    for name in names:
        while name not in mods and "." in name:
            name = name.rpartition(".")[0]
        if name in mods and name.startswith("asyncengine"):
            parts = name.split(".")
            out += [".".join(parts[:i]) for i in range(2, len(parts))]  # the packages it runs on the way
            out.append(name)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = _modules(root)
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):  # imports for type checkers only never run: not an edge
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(t for t in _targets(mods, name, node) if t != name)
        graph[name]  # every module is a node
    # an __init__ that only re-exports its own submodules (or nothing) stands for what it imports
    inits = {m for m in mods if mods[m].name == "__init__.py"}
    transparent = {m for m in inits if all(t.startswith(m + ".") for t in graph[m])}

    def through(target: str) -> set[str]:
        if target not in transparent:
            return {target}
        return set().union(set(), *(through(t) for t in graph[target]))

    for name in graph:
        importer_pkgs = {name.rsplit(".", i)[0] for i in range(name.count("."))}
        resolved = set().union(set(), *(through(t) for t in graph[name] if t not in importer_pkgs))
        graph[name] = resolved - {name}
    return graph


def folder_of(module: str, packages: set[str]) -> str:
    """``asyncengine.X`` for a module under the package ``asyncengine.X`` (or that package itself);
    ``asyncengine`` for the root's own files, but ``asyncengine.__main__``, an entry point, for itself."""
    top = ".".join(module.split(".")[:2])
    if top == "asyncengine.__main__":
        return top
    return top if top in packages else "asyncengine"


def layer_of(module: str, packages: set[str]) -> int:
    if module.rpartition(".")[2] == "__main__":
        return ENTRY_POINTS
    folder = folder_of(module, packages)
    floors = [i for i, (_, folders) in enumerate(LAYERS) if folder in folders]
    assert floors, f"{folder} is on no floor: add it to LAYERS in {__file__}"
    return floors[0]


def _packages(root: Path = ROOT) -> set[str]:
    return {m for m, path in _modules(root).items() if path.name == "__init__.py"}


def folder_graph(graph: dict[str, set[str]], packages: set[str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        here = folder_of(module, packages)
        out[here].update(folder_of(t, packages) for t in targets)
        out[here].discard(here)
    return out


def upward_imports(graph: dict[str, set[str]], packages: set[str]) -> list[str]:
    up = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target, packages) < layer_of(module, packages):
                up.append(f"{module} ({LAYERS[layer_of(module, packages)][0]}) -> "
                          f"{target} ({LAYERS[layer_of(target, packages)][0]})")
    return up


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_walk_sees_the_package():
    graph = import_graph()
    assert "asyncengine.core.scheduler" in graph and "asyncengine.kernels.cpu.attention" in graph
    assert "asyncengine.integrations.openai_server.app" in graph
    assert "asyncengine.contracts.sched_output" in graph["asyncengine.worker.model_runner"]


def test_every_folder_is_on_one_floor():
    packages = _packages()
    folders = {folder_of(m, packages) for m in import_graph()} - {"asyncengine.__main__"}
    listed = [f for _, fs in LAYERS for f in fs]
    assert sorted(listed) == sorted(set(listed)), "a folder on two floors"
    assert sorted(folders) == sorted(listed)


def test_the_checks_catch_a_cycle_and_an_upward_import():
    """The detectors themselves, on a made-up graph (so a broken walk cannot pass by finding nothing)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    packages = {"asyncengine.config", "asyncengine.worker"}
    assert layer_of("asyncengine.config.engine", packages) > layer_of("asyncengine.worker.worker", packages)
    assert layer_of("asyncengine.cli.__main__", packages) == layer_of("asyncengine.__main__", packages) == ENTRY_POINTS


def test_a_planted_upward_import_fails_the_walk(tmp_path):
    """A copy of the tree with one lazy import planted upward (the contracts reaching for the front
    end, inside a function): the walk reports that import, and the folder cycle it closes."""
    import shutil

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for folder in set(setup["package-dir"].values()):
        shutil.copytree(ROOT / folder, tmp_path / folder, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.h"))
    planted = tmp_path / "asyncengine" / "contracts" / "sched_output.py"
    planted.write_text(planted.read_text() + "\n\ndef _planted():\n    from asyncengine.engine import async_engine\n")
    graph, packages = import_graph(tmp_path), _packages(tmp_path)
    assert upward_imports(graph, packages) == [
        "asyncengine.contracts.sched_output (contracts: what crosses the executor seam) -> "
        "asyncengine.engine.async_engine (front end (imports no torch))"]
    assert any("asyncengine.contracts" in c and "asyncengine.engine" in c
               for c in _cycles(folder_graph(graph, packages)))
    assert upward_imports(import_graph(), _packages()) == []  # the plant, not the tree, is what fails


# Module cycles inside one folder that the design needs, each with why (none between folders).
CYCLES_INSIDE_A_FOLDER: set[tuple[str, str]] = set()  # none today (PDEngine is handed its cores' class)


def test_no_import_cycle():
    graph = {m: {t for t in ts if (m, t) not in CYCLES_INSIDE_A_FOLDER} for m, ts in import_graph().items()}
    assert _cycles(graph) == []
    assert all(a in import_graph()[b] and b in import_graph()[a] for a, b in CYCLES_INSIDE_A_FOLDER)


def test_no_folder_cycle():
    assert _cycles(folder_graph(import_graph(), _packages())) == []


def test_nothing_imports_upward():
    upward = upward_imports(import_graph(), _packages())
    assert upward == [], "imports that run up the floors:\n" + "\n".join(upward)
