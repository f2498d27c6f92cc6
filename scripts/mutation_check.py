#!/usr/bin/env python
"""Mutation check: delete or negate a guard, run the tests that should notice, and report which
mutants survive.

The mutants live in scripts/mutation_core.py (group ``core``) and scripts/mutation_wave.py (group
``wave``). Each names a file (under asyncengine/core/ when the name has no folder; else relative to the
repository: asyncengine/, kernels/, integrations/, C sources included), the exact code it replaces
(which must occur exactly once), what replaces it, and the test selection expected to kill it
(the area's own tests; ``-k`` expressions allowed). Mutants are applied to a copy of the checkout
(``--in-place``: to the checkout itself) and always undone (``finally``, plus SIGINT/SIGTERM
handlers); the tests run in a subprocess that writes no bytecode and sees the mutant with a new
mtime (so a same-size mutant is never served from a stale .pyc; a C source's new bytes give a new
kernel build key), under a timeout: a hang counts as killed, since a test suite that hangs fails CI.

pyproject's ``package-dir`` maps kernels/ and integrations/ into the package, so an installed
``asyncengine.kernels`` would be the checkout's, not the copy's: the copy gets its own links
(asyncengine/kernels -> ../kernels, asyncengine/integrations -> ../integrations,
integrations/web_chat -> ../examples/web_chat), its tests run with PYTHONPATH at the copy, and a
probe checks that all three packages import from the copy before any mutant runs.

    python scripts/mutation_check.py            # every mutant (hours on 2 cores)
    python scripts/mutation_check.py --list     # the mutants
    python scripts/mutation_check.py --check    # each applies once and compiles (seconds)
    python scripts/mutation_check.py sched.in_flight pool.evict   # some of them
    python scripts/mutation_check.py --group wave   # the last two waves' features (docs/mutation.md)

Not part of CI (too slow); the last run's score and the reasons for any survivor are in
docs/mutation.md.
"""
from __future__ import annotations

import argparse
import os
import py_compile
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutation_core import CORE as CORE_MUTANTS  # noqa: E402
from mutation_wave import WAVE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORE = "asyncengine/core/"


@dataclass
class Mutant:
    id: str
    file: str  # a bare name: under asyncengine/core/; else relative to the repository
    find: str
    replace: str
    tests: list[str]  # pytest arguments: files, node ids, "-k", "expr"
    what: str
    group: str = "core"  # core: asyncengine/core's guards (issue 16); wave: scripts/mutation_wave.py

    @property
    def path(self) -> str:
        return self.file if "/" in self.file else CORE + self.file


MUTANTS = [Mutant(*row) for row in CORE_MUTANTS] + [Mutant(*row, group="wave") for row in WAVE]


# ---------------------------------------------------------------------- running


class Restorer:
    """Puts the original file back on exit, however the process ends."""

    def __init__(self) -> None:
        self.saved: dict[Path, str] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        self.restore()
        raise SystemExit(128 + signum)

    def mutate(self, path: Path, text: str) -> None:
        st = path.stat()
        self.saved.setdefault(path, (path.read_text(), st.st_mtime_ns))
        path.write_text(text)
        os.utime(path, ns=(st.st_mtime_ns + 2_000_000_000, st.st_mtime_ns + 2_000_000_000))

    def restore(self) -> None:
        for path, (text, mtime) in self.saved.items():
            path.write_text(text)
            os.utime(path, ns=(mtime, mtime))
        self.saved.clear()


def mutated(m: Mutant, root: Path = ROOT) -> tuple[Path, str, str]:
    path = root / m.path
    src = path.read_text()
    n = src.count(m.find)
    if n != 1:
        raise SystemExit(f"{m.id}: the code to mutate occurs {n} times in {m.file} (must be exactly once)")
    return path, src, src.replace(m.find, m.replace, 1)


def check(mutants) -> None:
    with tempfile.TemporaryDirectory() as d:
        for m in mutants:
            _, _, text = mutated(m)
            if not m.path.endswith(".py"):
                continue  # a C source: compiled by the kernels' own build when its tests import it
            f = Path(d) / f"{m.id}.py"
            f.write_text(text)
            try:
                py_compile.compile(str(f), doraise=True)
            except py_compile.PyCompileError as e:
                raise SystemExit(f"{m.id}: the mutant does not compile: {e.msg}") from None
    print(f"{len(mutants)} mutants: each applies exactly once and compiles")


# the package-dir folders (pyproject.toml), linked into the copy's package so that it imports its own
PACKAGE_LINKS = {"asyncengine/kernels": "../kernels", "asyncengine/integrations": "../integrations",
                 "integrations/web_chat": "../examples/web_chat"}
PROBE = ("import asyncengine.core.scheduler as a, asyncengine.kernels.cpu.build as b, "
         "asyncengine.integrations.tool_calls as c, asyncengine.integrations.web_chat as d; "
         "print(a.__file__); print(b.__file__); print(c.__file__); print(list(d.__path__)[0])")


def test_env(root: Path) -> dict[str, str]:
    """PYTHONPATH at ``root`` (before the editable install's mapping), no bytecode written."""
    pp = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=str(root) + (os.pathsep + pp if pp else ""), PYTHONDONTWRITEBYTECODE="1")


def copy_checkout(dest: Path) -> Path:
    """The checkout's sources and tests in ``dest``, with the package-dir links; checked: the copy's
    core, kernels and integrations are what ``import asyncengine`` finds there."""
    shutil.copytree(ROOT, dest, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv", ".git", "__pycache__", ".hypothesis", ".benchmarks", "*.gguf", "*.egg-info", "build"))
    for link, target in PACKAGE_LINKS.items():
        p = dest / link
        if p.is_symlink() or p.exists():
            if not (p.is_symlink() and os.readlink(p) == target):
                raise SystemExit(f"{p} exists and is not the link -> {target}")
            continue
        p.symlink_to(target)
    files = subprocess.run([sys.executable, "-c", PROBE], cwd=dest, env=test_env(dest), capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if not Path(f).resolve().is_relative_to(dest.resolve()):
            raise SystemExit(f"the copy in {dest} would test {f}: use --in-place")
    return dest


def run_one(m: Mutant, root: Path, restorer: Restorer, timeout: float) -> tuple[str, str, float]:
    path, _, text = mutated(m, root)
    t0 = time.monotonic()
    env = test_env(root)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests]
    restorer.mutate(path, text)
    try:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole pytest process group we started
            proc.communicate()
            return "killed", f"timeout after {timeout:.0f} s (hang)", time.monotonic() - t0
    finally:
        restorer.restore()
    dt = time.monotonic() - t0
    if proc.returncode == 0:
        return "SURVIVED", "", dt
    if proc.returncode in (1, 3):  # tests failed / internal error while importing the mutant
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
        return "killed", failed[0] if failed else f"pytest exit {proc.returncode}", dt
    return "ERROR", f"pytest exit {proc.returncode}: {out[-300:]}", dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ids", nargs="*", help="mutant ids (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants")
    ap.add_argument("--check", action="store_true", help="only check that each mutant applies and compiles")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-mutant test timeout, seconds (a hang = killed)")
    ap.add_argument("--in-place", action="store_true", help="mutate the checkout itself (restored after each)")
    ap.add_argument("--group", choices=("core", "wave"), help="only this group's mutants")
    args = ap.parse_args()
    mutants = [m for m in MUTANTS if (not args.ids or m.id in args.ids) and args.group in (None, m.group)]
    unknown = set(args.ids) - {m.id for m in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutant ids: {sorted(unknown)}")
    if args.list:
        for m in mutants:
            print(f"{m.id:32} {m.path:48} {m.what}")
        return 0
    check(mutants)
    if args.check:
        return 0
    restorer = Restorer()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        root = ROOT if args.in_place else copy_checkout(Path(tmp) / "repo")
        for m in mutants:
            status, by, dt = run_one(m, root, restorer, args.timeout)
            rows.append((m, status, by, dt))
            print(f"{status:8} {m.id:32} {dt:6.1f}s  {by}", flush=True)
    killed = sum(r[1] == "killed" for r in rows)
    print("\n| mutant | file | guard | result | first failing test |\n|---|---|---|---|---|")
    for m, status, by, _ in rows:
        print(f"| `{m.id}` | {m.path} | {m.what} | {status} | {by} |")
    print(f"\nscore: {killed}/{len(rows)} killed; survivors: "
          f"{', '.join(m.id for m, s, _, _ in rows if s != 'killed') or 'none'}")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
