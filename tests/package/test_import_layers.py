"""The package reads in the order data flows: no import cycle in ``asyncengine/``, and no module
imports a layer above its own.

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

# Top first: a module may import its own layer or any layer below it, never one above. A name
# matches the longest prefix listed (so ``asyncengine.attention.registry`` sits with the config,
# below the attention backends it names). ``asyncengine`` alone is the package's __init__ (lazy).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry points", ("asyncengine.__main__", "asyncengine.cli", "asyncengine.integrations")),
    ("public API (lazy re-exports)", ("asyncengine",)),
    # the engine core (engine/core.py) belongs with the engine, above the executor it drives
    ("front end and engine core", ("asyncengine.engine",)),
    ("executors", ("asyncengine.executor",)),
    ("worker (model runner, sampler)", ("asyncengine.worker",)),
    # beside the KV-cache manager (scheduler side) and the model runner (worker side): the engine
    # core and the runner make theirs; its step messages sit with the scheduler's
    ("KV connectors", ("asyncengine.kv_connector",)),
    ("speculative proposers", ("asyncengine.spec_decode",)),
    # models run over the attention backends (as vLLM's models import vllm.attention): a model's
    # native decode step reads the CPU backend's metadata; the backends know no model
    ("models", ("asyncengine.models",)),
    ("attention backends", ("asyncengine.attention",)),
    ("layers", ("asyncengine.layers",)),
    ("scheduler, KV-cache manager, step messages", ("asyncengine.core", "asyncengine.kv_connector.messages")),
    ("structured outputs", ("asyncengine.structured",)),
    ("configuration", ("asyncengine.config", "asyncengine.spec_decode.config", "asyncengine.attention.registry",
                       "asyncengine.platforms", "asyncengine.structured.limits")),
    ("kernels", ("asyncengine.kernels",)),  # leaf compute: they know no config, no model
    ("public types", ("asyncengine.sampling_params", "asyncengine.outputs", "asyncengine.request_limits",
                      "asyncengine.structured.params")),
    ("errors", ("asyncengine.errors",)),
]

# Edges allowed while a known cycle is being removed; each is (importer, imported), with why. None now.
PENDING: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped: dict[str, str] = setup["package-dir"]
    mods: dict[str, Path] = {}
    for pkg, folder in mapped.items():
        if pkg.count(".") > 1:  # data-only packages (the web chat page)
            continue
        base = ROOT / folder
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


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = index, len(p)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return best


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
    assert "asyncengine.core.sched_output" in graph["asyncengine.worker.model_runner"]


def test_the_checks_catch_a_cycle_and_an_upward_import():
    """The detectors themselves, on a made-up graph (so a broken walk cannot pass by finding nothing)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("asyncengine.config") > layer_of("asyncengine.worker.worker")
    assert layer_of("asyncengine.attention.registry") > layer_of("asyncengine.attention.selector")


def test_no_import_cycle():
    graph = import_graph()
    graph = {m: {t for t in ts if (m, t) not in PENDING} for m, ts in graph.items()}
    assert _cycles(graph) == []


def test_nothing_imports_upward():
    upward = []
    for module, targets in sorted(import_graph().items()):
        for target in sorted(targets):
            if layer_of(target) < layer_of(module) and (module, target) not in PENDING:
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})")
    assert upward == [], "imports that run up the layers:\n" + "\n".join(upward)


def test_pending_edges_still_exist():
    """Each allowance above names an edge that still exists: once it is gone, delete its line."""
    graph = import_graph()
    assert sorted(e for e in PENDING if e[1] not in graph.get(e[0], ())) == []
