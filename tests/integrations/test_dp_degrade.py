"""``asyncengine serve --data-parallel-size 2`` when its engine cores die: one core killed, its
stream fails (503, "engine_core_dead"), the stream on the other core completes, new requests
succeed and /health says degraded with one core alive; the last core killed, requests get 503 and
the server exits non-zero (a supervisor restarts it)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from live_server import HANG_GUARD_S


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cores(pid: int) -> list[int]:
    """The engine-core processes of the server (multiprocessing spawn children)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(d))
    return sorted(out)


def _stream(c: openai.OpenAI, results: list, progress: list) -> None:
    try:
        n = 0
        for ch in c.completions.create(model=c.model_id, prompt=[5, 17, 33], max_tokens=300, stream=True,
                                       temperature=0.0, extra_body={"ignore_eos": True}):
            if ch.choices and ch.choices[0].text:
                n += 1
                progress.append(n)
            if ch.choices and ch.choices[0].finish_reason:
                results.append(("done", ch.choices[0].finish_reason, n))
                return
        results.append(("ended", None, n))
    except Exception as e:  # the killed core's stream
        results.append(("error", e, 0))


def test_one_dead_core_degrades_all_dead_exits_non_zero(tiny_llama_dir, tmp_path):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "asyncengine", "serve", tiny_llama_dir, "--host", "127.0.0.1",
                             "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
                             "--num-threads", "1", "--data-parallel-size", "2"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        for _ in range(int(HANG_GUARD_S / 0.1)):
            assert proc.poll() is None, "serve exited during start-up"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        cores = _cores(proc.pid)
        assert len(cores) == 2, cores
        with openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=HANG_GUARD_S) as c:
            c.model_id = c.models.list().data[0].id
            results: list = []
            progress: list[list] = [[], []]
            threads = [threading.Thread(target=_stream, args=(c, results, progress[i])) for i in range(2)]
            for t in threads:
                t.start()
            for _ in range(int(HANG_GUARD_S / 0.05)):  # both streams are running (one on each core)
                if all(progress):
                    break
                time.sleep(0.05)
            assert all(progress), results
            os.kill(cores[0], signal.SIGKILL)
            for t in threads:
                t.join(HANG_GUARD_S)
            assert sorted(r[0] for r in results) == ["done", "error"], results
            done = next(r for r in results if r[0] == "done")
            assert done[1] == "length" and done[2] > 0
            err = next(r[1] for r in results if r[0] == "error")
            assert isinstance(err, openai.APIError)
            for i in range(3):  # new requests go to the core left
                r = c.completions.create(model=c.model_id, prompt=[7, i], max_tokens=4, extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 4
            h = httpx.get(base + "/health", timeout=5)
            assert h.status_code == 200 and h.json() == {"status": "degraded", "cores_alive": 1, "cores": 2}
            # the last core: the engine is dead, 503 (never 500), and the server exits non-zero
            os.kill(cores[1], signal.SIGKILL)
            statuses = []
            for _ in range(int(HANG_GUARD_S / 0.1)):
                try:
                    r = httpx.post(base + "/v1/completions", json={"model": c.model_id, "prompt": "x", "max_tokens": 2},
                                   timeout=10)
                    statuses.append(r.status_code)
                    if r.status_code == 503:
                        assert "Traceback" not in r.text and r.json()["error"]["code"] == "engine_dead"
                        assert r.json()["error"]["param"] is None  # a dead engine is no field's fault
                        break
                except httpx.TransportError:
                    break  # already gone
                time.sleep(0.1)
            assert statuses and statuses[-1] == 503 and 500 not in statuses, statuses
        proc.wait(timeout=HANG_GUARD_S)
        assert proc.returncode not in (0, None)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.seek(0)
        text = log.read()
        log.close()
    assert "engine core" in text  # the death is in the log (with its traceback, if any)
