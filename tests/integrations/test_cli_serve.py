"""``asyncengine serve`` as a user runs it: a subprocess on 127.0.0.1, the API key from
$ASYNCENGINE_API_KEY, the openai client against it, then Ctrl-C (SIGINT) for a clean exit."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from live_server import HANG_GUARD_S


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_serve(model_dir: str, tmp_path, *args: str, env: dict | None = None):
    """``python -m asyncengine serve MODEL`` on a free 127.0.0.1 port, healthy before the block runs;
    yields (process, base URL). Afterwards Ctrl-C (SIGINT), which must exit it cleanly (code 0)."""
    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "asyncengine", "serve", model_dir, "--host", "127.0.0.1",
                             "--port", str(port), *args], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(int(HANG_GUARD_S / 0.1)):
            if proc.poll() is not None:
                break
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            pytest.fail("the server never became healthy")
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"asyncengine serve exited with {proc.returncode}:\n{log.read()[-3000:]}")
        yield proc, base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        finally:
            log.close()
    assert proc.returncode == 0


def test_serve_subcommand(tiny_llama_dir, tmp_path):
    with running_serve(tiny_llama_dir, tmp_path, "--dtype", "float32", "--max-model-len", "256",
                       env={"ASYNCENGINE_API_KEY": "sk-from-env"}) as (_, base):
        with openai.OpenAI(base_url=base + "/v1", api_key="sk-from-env", max_retries=0, timeout=HANG_GUARD_S) as c:
            [model] = c.models.list().data
            assert model.id == tiny_llama_dir  # served under the name it was given
            r = c.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 4
            assert c.models.retrieve(model.id).model_extra["max_model_len"] == 256
        with openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        assert httpx.get(base + "/metrics").status_code == 401  # the key covers everything but /health
        assert httpx.get(base + "/metrics", headers={"authorization": "Bearer sk-from-env"}).status_code == 200
