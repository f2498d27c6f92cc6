"""One engine-client interface (asyncengine/engine/protocol.py): every front end implements all of
it with the protocol's parameters, the factory returns the right one for a config, and the code
that drives an engine (the server, the adapters, the anyio bridge, the CLI) uses nothing else."""
from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from asyncengine.config import EngineConfig
from asyncengine.engine.async_engine import AsyncLLMEngine
from asyncengine.engine.pd_client import PDEngine
from asyncengine.engine.protocol import EngineClient

ROOT = Path(__file__).resolve().parents[2]
FRONT_ENDS = [AsyncLLMEngine, PDEngine]
ATTRIBUTES = ("config", "tokenizer", "limits", "default_sampling_params")


def _members() -> dict[str, object]:
    return {n: v for n, v in vars(EngineClient).items()
            if not n.startswith("_") or n in ("__aenter__", "__aexit__")}


def _assigned_on_self(cls: type) -> set[str]:
    """Names a class's methods assign as ``self.<name> = ...`` (its plain attributes)."""
    names = set()
    for klass in cls.__mro__:
        if klass is object or not klass.__module__.startswith("asyncengine"):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            names |= {t.attr for t in targets if isinstance(t, ast.Attribute)
                      and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return names


@pytest.mark.parametrize("cls", FRONT_ENDS, ids=lambda c: c.__name__)
def test_every_front_end_implements_the_whole_protocol(cls):
    assert issubclass(cls, EngineClient) and not inspect.isabstract(cls), sorted(cls.__abstractmethods__)
    for name, member in _members().items():
        if name in ATTRIBUTES:
            continue
        impl = inspect.getattr_static(cls, name)
        if isinstance(member, property):
            assert isinstance(impl, property), f"{cls.__name__}.{name} is not a property"
            continue
        assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(member), name
        want = list(inspect.signature(member).parameters.values())
        have = inspect.signature(impl).parameters
        for p in want:
            assert p.name in have, f"{cls.__name__}.{name} lacks parameter {p.name}"
            assert (have[p.name].kind, have[p.name].default) == (p.kind, p.default), f"{cls.__name__}.{name}({p.name})"
        extra = [p for n, p in have.items() if n not in {w.name for w in want}]
        assert all(p.default is not inspect.Parameter.empty or p.kind is p.VAR_KEYWORD for p in extra), \
            f"{cls.__name__}.{name} needs arguments the protocol does not give: {extra}"
    assert set(ATTRIBUTES) == set(EngineClient.__annotations__)
    attrs = _assigned_on_self(cls)
    for name in ATTRIBUTES:
        assert name in attrs or isinstance(inspect.getattr_static(cls, name, None), property), f"{cls.__name__}.{name}"


def test_the_checks_catch_a_front_end_that_lacks_a_member():
    class Partial(EngineClient):
        def generate(self, prompt, sampling_params=None, request_id=None, *, priority=0, cache_salt=None):
            raise NotImplementedError

    assert inspect.isabstract(Partial) and "abort" in Partial.__abstractmethods__


def test_complete_is_written_once():
    for cls in FRONT_ENDS:
        assert inspect.getattr_static(cls, "complete") is EngineClient.__dict__["complete"]


def test_the_factory_picks_pd_for_prefill_cores_and_one_engine_otherwise(monkeypatch):
    """``AsyncLLMEngine.from_config``: P/D is reached as data parallel is, through the one factory."""
    built = []
    monkeypatch.setattr(PDEngine, "__init__", lambda self, config, core_engine: built.append(("pd", config, core_engine)))
    monkeypatch.setattr(AsyncLLMEngine, "__init__", lambda self, config, core=None: built.append(("one", config)))
    pd = EngineConfig(model="m", prefill_cores=1, decode_cores=1)
    dp = EngineConfig(model="m", data_parallel_size=2)
    assert isinstance(AsyncLLMEngine.from_config(pd), PDEngine)
    assert isinstance(AsyncLLMEngine.from_config(dp), AsyncLLMEngine)
    assert built == [("pd", pd, AsyncLLMEngine), ("one", dp)]  # P/D cores are AsyncLLMEngines


def _engine_attributes(path: Path) -> set[str]:
    """Attributes read off an engine object (``engine.x``, ``self.engine.x``, ``self._engine.x``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id in ("engine", "eng", "_engine")) or \
                (isinstance(v, ast.Attribute) and v.attr in ("engine", "_engine")):
            out.add(node.attr)
    return out


def test_drivers_use_only_the_protocol():
    members = set(_members()) | set(ATTRIBUTES) | {"from_config"}
    files = [*sorted((ROOT / "integrations").rglob("*.py")), ROOT / "asyncengine/engine/anyio_bridge.py",
             ROOT / "asyncengine/engine/warmup.py", *sorted((ROOT / "asyncengine/cli").glob("*.py"))]
    used = {f.relative_to(ROOT).as_posix(): _engine_attributes(f) - members for f in files}
    assert sum(bool(_engine_attributes(f)) for f in files) >= 5  # the walk sees the drivers
    assert {f: u for f, u in used.items() if u} == {}


# the front end's internals the server reached for before the protocol had check_messages and
# check_token_ids: what it needs of them goes through the engine client now
ENGINE_INTERNALS = ("asyncengine.engine.validation", "asyncengine.engine.request_stream")


def _imported_modules(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return mods


def test_the_server_does_not_import_the_front_ends_internals():
    files = sorted((ROOT / "integrations/openai_server").rglob("*.py"))
    assert files
    found = {f.relative_to(ROOT).as_posix(): sorted(_imported_modules(f) & set(ENGINE_INTERNALS)) for f in files}
    assert {f: m for f, m in found.items() if m} == {}, \
        "the server asks the engine client (asyncengine/engine/protocol.py): extend the protocol instead"
