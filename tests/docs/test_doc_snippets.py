"""Every Python code block of README.md and docs/*.md runs as written, with the default model
(SmolLM2-135M-Instruct), so a snippet that breaks fails CI, and what it prints is a sensible
answer (tests/docs/answers.py: no loop, mostly English words). Blocks that need a server run while
``asyncengine serve`` runs; blocks marked as fragments are compiled only (tests/docs/snippets.py
says how a block is marked). The runnable blocks share one process (tests/docs/snippet_runner.py):
one torch import, and what they share by name loads once."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from answers import degenerate
from snippets import SERVER_ADDRESS, snippets

pytestmark = pytest.mark.smollm2

ALL = snippets()
RUNNABLE = [s for s in ALL if s.fragment is None]
FRAGMENTS = [s for s in ALL if s.fragment is not None]
ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
HANG_GUARD_S = 1800  # only against a hang; nothing here is timed


def test_the_docs_have_snippets_and_most_run():
    assert len(RUNNABLE) >= 8 and len(RUNNABLE) > len(FRAGMENTS)
    assert any(s.needs_server for s in RUNNABLE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_address():
    """``asyncengine serve`` with the default model on a free port, while the snippets run."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "asyncengine", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        for _ in range(3000):  # until /health answers, or the server exits (a bounded wait)
            if proc.poll() is not None:
                raise AssertionError(f"asyncengine serve exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError("asyncengine serve never became healthy")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def results(tmp_path_factory, server_address):
    """Run every runnable snippet once (in one process, in document order)."""
    folder = tmp_path_factory.mktemp("snippets")
    todo = [{"where": s.where, "code": s.code.replace(SERVER_ADDRESS, server_address) if s.needs_server else s.code}
            for s in RUNNABLE]
    (folder / "todo.json").write_text(json.dumps(todo))
    runner = Path(__file__).with_name("snippet_runner.py")
    proc = subprocess.run([sys.executable, str(runner), str(folder / "todo.json"), str(folder / "results.json")],
                          capture_output=True, text=True, env=ENV, cwd=folder, timeout=HANG_GUARD_S)
    done = json.loads((folder / "results.json").read_text()) if (folder / "results.json").exists() else {}
    if len(done) < len(todo):
        missing = todo[len(done)]["where"]
        pytest.fail(f"the snippet runner died at {missing} (rc {proc.returncode}): {proc.stderr[-3000:]}")
    return done


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[s.where for s in RUNNABLE])
def test_snippet_runs_as_written(snippet, results):
    r = results[snippet.where]
    assert r["error"] is None, f"{snippet.where} failed:\n{r['error']}\n--- it printed:\n{r['stdout'][-2000:]}"
    assert r["stdout"].strip(), f"{snippet.where} printed nothing"
    if snippet.check_answer:  # and what it printed is a sensible answer, as written (default sampling)
        why = degenerate(r["stdout"])
        assert why is None, f"{snippet.where} printed a degenerate answer: {why}\n--- it printed:\n{r['stdout'][-2000:]}"


@pytest.mark.parametrize("snippet", FRAGMENTS, ids=[f"{s.where} (fragment: {s.fragment})" for s in FRAGMENTS])
def test_fragment_compiles(snippet):
    """Marked as a fragment in the doc (the reason is in the test id): only its syntax is checked."""
    compile(snippet.code, snippet.where, "exec")
