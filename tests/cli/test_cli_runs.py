"""The chat and generate commands run end to end on a tiny GGUF: bounded by default, failed
questions visible in the exit status, the ready line naming the dtype and why."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from gguf_utils import tiny_hf_model, tiny_tokenizer, write_tiny_gguf

from asyncengine.cli.args import GENERATE_MAX_TOKENS

ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


def run_cli(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncengine", *args], capture_output=True, text=True,
                          input=input, timeout=600, env=ENV)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tok = tiny_tokenizer()
    model = tiny_hf_model("llama", vocab_size=tok.get_vocab_size())
    return str(write_tiny_gguf(tmp_path_factory.mktemp("cli") / "tiny.gguf", model, tok, qtype="Q8_0"))


def _answers(stderr: str) -> list[int]:
    return [int(n) for n in re.findall(r"^\[(\d+) tokens", stderr, re.M)]


def test_generate_without_max_tokens_ends_by_itself(tiny_gguf):
    r = run_cli("generate", "--model", tiny_gguf, "--prompt", "Once upon a time", "--dtype", "float32",
                "--temperature", "0")
    assert r.returncode == 0, r.stderr
    (n,) = _answers(r.stderr)
    assert 1 <= n <= GENERATE_MAX_TOKENS
    if n == GENERATE_MAX_TOKENS:
        assert f"cut at {GENERATE_MAX_TOKENS} tokens, generate's default (--max-tokens N for more)" in r.stderr


def test_a_failed_one_shot_question_exits_non_zero(tiny_gguf):
    long_question = " ".join(["word"] * 200)
    r = run_cli("chat", tiny_gguf, "--dtype", "float32", "--max-model-len", "32", "--prompt", long_question)
    assert r.returncode == 1, r.stderr
    assert "asyncengine: error: the prompt is" in r.stderr and "max_model_len is 32" in r.stderr
    assert "/reset" not in r.stderr  # nothing to reset in a one-shot question
    r = run_cli("generate", "--model", tiny_gguf, "--dtype", "float32", "--max-model-len", "32",
                "--prompt", long_question)
    assert r.returncode == 1 and "asyncengine: error: the prompt is" in r.stderr


def test_piped_chat_answers_the_rest_and_reports_a_failed_question(tiny_gguf):
    long_question = " ".join(["word"] * 200)
    r = run_cli("chat", tiny_gguf, "--dtype", "float32", "--max-model-len", "64", "--max-tokens", "2",
                input=f"{long_question}\nshort one\n")
    assert r.returncode == 1, r.stderr  # one question got no answer: a script can tell
    assert "ask a shorter question, or raise --max-model-len" in r.stderr
    assert _answers(r.stderr) == [2]  # the second question was still answered
    # the ready line comes after the warm-up and says which dtype runs and why
    assert re.search(r"asyncengine: ready, float32 \(asked for\);[^\n]*cpu attention \(\d+\.\d s after launch\)", r.stderr), r.stderr


def test_serve_warms_up_then_says_ready_with_the_dtype(tiny_gguf):
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "asyncengine", "serve", tiny_gguf, "--port", str(port),
                             "--dtype", "float32", "--max-num-seqs", "4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        lines = []
        for line in proc.stderr:  # until the ready line (or the server exits)
            lines.append(line)
            if "asyncengine: ready" in line:
                break
        ready = lines[-1]
        assert re.search(rf"ready, float32 \(asked for\);[^\n]*cpu attention, serving on http://127\.0\.0\.1:{port} \(", ready), lines
        for _ in range(600):  # the socket opens right after the ready line (a bounded wait)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
                    metrics = r.read().decode()
                break
            except OSError:
                time.sleep(0.1)
        # the warm-up request ran before any client: its prompt already went through the prefix cache
        queried = re.search(r"^asyncengine_prefix_cache_queries(?:_total)? ([\d.e+]+)$", metrics, re.M)
        assert queried and float(queried.group(1)) > 0, metrics[:3000]
    finally:
        proc.terminate()
        proc.wait(60)
