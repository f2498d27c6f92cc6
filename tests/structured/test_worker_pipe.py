"""Grammar compile workers cost what they are (structured/worker_pipe.py, compile_worker.py): a
worker loads xgrammar's compiler without torch or transformers, starts ahead of the first request
when warmed, and is replaced (its memory returned) once worn."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("xgrammar")

from asyncengine import EngineConfig  # noqa: E402
from asyncengine.models.model_info import load_model_info  # noqa: E402
from asyncengine.structured import StructuredOutputsParams as SO  # noqa: E402
from asyncengine.structured import worker_pipe  # noqa: E402
from asyncengine.structured.backend import compiler_for  # noqa: E402
from asyncengine.structured.compile_service import CompileService  # noqa: E402
from asyncengine.config.grammar_limits import GrammarLimits  # noqa: E402


@pytest.fixture
def service(tiny_llama_dir):
    lim = GrammarLimits()
    info = load_model_info(EngineConfig(model=tiny_llama_dir))
    s = CompileService(compiler_for(tiny_llama_dir, info.tokenizer, info.vocab_size, [1], lim), lim)
    yield s
    s.close()


def _workers(service) -> list[worker_pipe.Worker]:
    """The service's idle workers (put back as they were)."""
    out = []
    while not service._workers.empty():
        out.append(service._workers.get())
    for w in out:
        service._workers.put(w)
    return [w for w in out if w is not None]


def test_a_worker_loads_neither_torch_nor_transformers(service):
    service.warm()
    (w,) = _workers(service)
    assert w.ready and w.alive()  # warmed: ready before any request
    maps = open(f"/proc/{w.proc.pid}/maps").read()
    assert "xgrammar" in maps  # the compiler's native library is loaded ...
    assert "libtorch" not in maps and "/torch/" not in maps  # ... and torch's are not
    out = asyncio.run(service.compile(SO(json={"type": "object", "properties": {"a": {"type": "integer"}}})))
    assert out.compiled
    assert _workers(service) == [w] and service.stats["compiles"] == 1  # the warmed worker did it


def test_a_worn_worker_is_replaced_and_the_compiles_go_on(service, monkeypatch):
    monkeypatch.setattr(worker_pipe, "WORKER_MAX_COMPILES", 2)

    async def main():
        return [await service.compile(SO(choice=[f"v{i}", f"w{i}"])) for i in range(5)]

    outs = asyncio.run(main())
    assert all(o.compiled for o in outs)
    assert service.stats["compiles"] == 5 and service.stats["recycled"] == 2
    (w,) = _workers(service)
    assert w.compiles == 1 and w.alive()  # the third worker, one compile in


def test_a_worker_over_its_memory_bound_is_replaced(service, monkeypatch):
    service.warm()
    (first,) = _workers(service)
    monkeypatch.setattr(worker_pipe, "WORKER_MAX_RSS", 1 << 20)  # any worker is over 1 MB
    assert asyncio.run(service.compile(SO(regex="[a-c]{1,4}"))).compiled
    (w,) = _workers(service)
    assert w is not first and not first.alive() and service.stats["recycled"] == 1
