#!/usr/bin/env python
"""Mutation check: delete or negate a guard, run the tests that should notice, and report which
mutants survive.

Each mutant names a file (under asyncengine/core/ when the name has no folder; else relative to the
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
from mutation_wave import WAVE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORE = "asyncengine/core/"

# test selections, fastest first (``-x`` stops at the first failure)
SCHED = ["tests/core/test_scheduler.py", "tests/core/test_prefix_caching.py", "tests/core/test_priority.py"]
PREFIX = ["tests/core/test_prefix_caching.py", "tests/core/test_block_pool.py", "tests/core/test_scheduler.py"]
POOL = ["tests/core/test_block_pool.py", "tests/core/test_prefix_caching.py"]
SAMPLES = ["tests/core/test_prefix_caching.py", "tests/core/test_scheduler.py", "tests/engine/test_sampling_e2e.py"]
STOPS = ["tests/engine/test_sampling_e2e.py", "tests/core/test_scheduler.py"]
PRIORITY = ["tests/core/test_priority.py", "tests/core/test_prefix_caching.py", "tests/core/test_scheduler.py"]
METRICS = ["tests/core/test_metrics.py", "tests/core/test_prefix_caching.py"]


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


M = Mutant
MUTANTS = [
    # ------------------------------------------------------------------ scheduler.py
    M("sched.dup_id", "scheduler.py",
      "        if rid in self.requests or rid in self.samples.parents or rid in self.kv_transfer.leases:\n"
      "            raise ValueError(",
      "        if False:\n            raise ValueError(",
      ["tests/core/test_scheduler.py", "tests/engine/test_sampling_e2e.py"], "a request id already in the engine is refused"),
    M("sched.dup_child_id", "scheduler.py",
      "            if c.request_id in self.requests:\n                raise ValueError(",
      "            if False:\n                raise ValueError(",
      ["tests/core/test_scheduler.py", "tests/engine/test_sampling_e2e.py"],
      "a sample id already in the engine is refused"),
    M("sched.hold_off", "parallel_samples.py",
      "        hold = (self.kv.enable_caching and (leader.num_prompt_tokens - 1) // self.kv.block_size > 0\n"
      "                or self.kv.plan_fork(leader) > 0)",
      "        hold = False",
      SAMPLES, "n > 1 with prefix caching: samples 1..n-1 wait for sample 0's prompt (one prefill)"),
    M("sched.hold_no_block", "parallel_samples.py",
      "        hold = (self.kv.enable_caching and (leader.num_prompt_tokens - 1) // self.kv.block_size > 0\n",
      "        hold = (self.kv.enable_caching\n",
      SAMPLES, "no hold when the prompt has no full block to share"),
    M("sched.release_finished_leader", "parallel_samples.py",
      "        ready = [c for c in self.held if c.hold_for.is_finished\n                 or ",
      "        ready = [c for c in self.held if ", SAMPLES,
      "held samples are released when sample 0 is gone (aborted / finished)"),
    M("sched.release_front", "parallel_samples.py",
      "            self.waiting.push_front(c)\n\n    def fork(",
      "            self.waiting.add(c)\n\n    def fork(", SAMPLES,
      "released samples queue at the front (they arrived with sample 0)"),
    M("sched.abort_missing", "scheduler.py",
      "                req = self.requests.get(cid)\n                if req is None:\n                    continue\n",
      "                req = self.requests.get(cid)\n", ["tests/core/test_scheduler.py", "tests/engine/test_async_engine.py"],
      "aborting an id that is not (or no longer) here is a no-op"),
    M("sched.finish_held", "scheduler.py",
      "        elif req.hold_for is not None:\n            self.samples.unhold(req)\n",
      "", SAMPLES, "finishing a held sample takes it out of the hold"),
    M("sched.finish_parent", "parallel_samples.py",
      "                if not kids:\n                    del self.parents[req.parent_id]\n",
      "", SAMPLES, "the n > 1 bookkeeping forgets a request whose samples are all gone"),
    M("sched.preempt_reset", "scheduler.py",
      "        req.num_computed_tokens = 0\n        req.num_preemptions += 1",
      "        req.num_preemptions += 1", SCHED, "a preempted request recomputes from position 0"),
    M("sched.preempt_tell_runner", "scheduler.py",
      "        self.waiting.push_front(req)\n        self._finished_ids.append(req.request_id)\n",
      "        self.waiting.push_front(req)\n", SCHED, "the runner is told to forget a preempted request"),
    M("sched.outranks", "scheduler.py",
      "        if not self.waiting.outranks(req, victim):\n            return False\n",
      "", PRIORITY, "priority: only a strictly better waiting request preempts"),
    M("sched.lower_uncache", "scheduler.py",
      "        if victim.request_id in num_scheduled and not self.kv.uncache_unscheduled(victim):\n"
      "            return False\n", "", PREFIX,
      "priority: a victim already scheduled this step has its fresh blocks uncached (or is kept)"),
    M("sched.max_tokens", "scheduler.py",
      "            if len(req.output_token_ids) + req.num_output_placeholders >= req.max_tokens:\n"
      "                return 0\n", "                pass\n", SCHED,
      "no step samples past max_tokens (placeholders counted)"),
    M("sched.running_uncache", "scheduler.py",
      "                if victim.request_id in num_scheduled:  # nothing hit its fresh blocks yet this step\n"
      "                    uncached = self.kv.uncache_unscheduled(victim)\n                    assert uncached\n",
      "", PREFIX, "phase 1: a victim scheduled earlier in this step has its fresh blocks uncached"),
    M("sched.running_index", "scheduler.py",
      "                if vi < i:\n                    i -= 1\n", "", SCHED,
      "phase 1: the loop index follows a victim removed before it"),
    M("sched.self_victim", "scheduler.py",
      "                if victim is req:\n                    break\n", "", SCHED,
      "phase 1: a request that is its own victim stops asking for blocks"),
    M("sched.no_admit_after_preempt", "scheduler.py",
      "        if not preempted:\n", "        if True:\n", SCHED,
      "nothing is admitted in a step that had to preempt"),
    M("sched.in_flight", "scheduler.py",
      "                if req.num_output_placeholders or req.request_id in self.pp_in_flight:\n",
      "                if req.request_id in self.pp_in_flight:\n", SCHED, "a preempted request with a token in flight is not re-admitted before it lands"),
    M("sched.max_num_seqs", "scheduler.py",
      "                if len(self.running) >= self.max_num_seqs:\n",
      "                if False:\n", SCHED, "at most max_num_seqs running"),
    M("sched.unchunked", "scheduler.py",
      "                    if not self.enable_chunked_prefill:\n                        break\n", "", SCHED,
      "chunked prefill off: a prompt that does not fit the budget waits whole"),
    M("sched.admit_alloc_fail", "scheduler.py",
      "                        budget = self.max_num_batched_tokens - sum(num_scheduled.values())\n"
      "                        continue\n                    break\n",
      "                        budget = self.max_num_batched_tokens - sum(num_scheduled.values())\n"
      "                        continue\n                    continue\n", SCHED,
      "admission stops at the first waiting request that does not fit (no overtaking, no spin)"),
    M("sched.cached_tokens_once", "scheduler.py",
      "                if req.num_cached_tokens < 0:\n                    req.num_cached_tokens = num_hit\n",
      "                req.num_cached_tokens = num_hit\n",
      ["tests/core/test_scheduler.py", "tests/core/test_prefix_caching.py", "tests/engine/test_sampling_e2e.py"],
      "num_cached_tokens is the first admission's hit (a recompute's hit does not overwrite it)"),
    M("sched.queue_time_once", "scheduler.py",
      "                if req.first_scheduled_time is None:\n", "                if True:\n", METRICS,
      "queue time counts a request's first admission only"),
    M("sched.placeholder", "scheduler.py",
      "            if req.num_computed_tokens >= req.num_tokens_with_placeholders:\n"
      "                req.num_output_placeholders += 1 + spec.get(rid, 0)\n", "", SCHED,
      "a step that reaches the end of a request's tokens adds an output placeholder"),
    M("sched.update_gone", "scheduler.py",
      "            if req is None:\n                continue  # finished or aborted while this step was in flight\n",
      "", SCHED, "a token for a request that finished while its step was in flight is dropped"),
    M("sched.update_finish", "scheduler.py",
      "            if status is not None:\n                self._finish(req, status)\n", "", SCHED,
      "a request that hit a stop condition is finished (blocks freed)"),
    M("sched.prompt_lps_skip", "scheduler.py",
      "        new = entries[skip:] if skip else entries\n", "        new = entries\n",
      ["tests/engine/test_sampling_e2e.py"], "a recompute does not resend prompt logprobs already delivered"),
    # ------------------------------------------------------------------ kv_cache_manager.py
    M("kv.prompt_logprobs_bypass", "kv_cache_manager.py",
      "        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:",
      "        if not self.enable_caching:", ["tests/core/test_prefix_caching.py", "tests/engine/test_sampling_e2e.py"],
      "requests with prompt logprobs bypass the prefix cache (every position computed)"),
    M("kv.caching_off", "kv_cache_manager.py",
      "        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:",
      "        if req.sampling_params.prompt_logprobs is not None:", PREFIX,
      "prefix caching off: no lookups"),
    M("kv.last_token", "kv_cache_manager.py",
      "        max_blocks = (n - 1) // self.block_size", "        max_blocks = n // self.block_size", PREFIX,
      "a hit always leaves the last token to compute (its logits are needed)"),
    M("kv.hit_chain", "kv_cache_manager.py",
      "            if b is None:\n                break\n", "            if b is None:\n                continue\n",
      PREFIX, "a hit is a run of blocks from the start (a miss ends it)"),
    M("kv.reclaimed", "kv_cache_manager.py",
      "        if need > self.pool.num_free_blocks - reclaimed:", "        if need > self.pool.num_free_blocks:",
      PREFIX, "free hit blocks stop being free once touched (all-or-nothing allocation)"),
    M("kv.empty_table", "kv_cache_manager.py",
      "            if not blocks:\n                del self.req_to_blocks[req.request_id]\n", "", PREFIX,
      "a failed first allocation leaves no empty block table behind"),
    M("kv.known_only", "kv_cache_manager.py",
      "            self._cache_full_blocks(req, blocks, min(total, req.num_tokens))",
      "            self._cache_full_blocks(req, blocks, total)", PREFIX,
      "only blocks full of known tokens are registered (placeholders are not)"),
    M("kv.register_once", "kv_cache_manager.py",
      "        if n_full <= start:\n            return\n", "", PREFIX,
      "blocks already registered are not registered again"),
    M("kv.uncache_refuse", "kv_cache_manager.py",
      "        if any(b.ref_cnt > 1 for b in fresh):\n            return False\n", "", PREFIX,
      "a victim whose fresh blocks a same-step hit relies on is not uncached"),
    M("kv.uncache_first", "kv_cache_manager.py",
      "        first = req.num_computed_tokens // self.block_size  # blocks before it were written earlier",
      "        first = 0", PREFIX, "uncaching spares blocks written by earlier steps"),
    M("kv.uncache_count", "kv_cache_manager.py",
      "        if end > first:\n            self._num_cached_blocks[req.request_id] = first\n", "", PREFIX,
      "after uncaching, those blocks can be registered again when really written"),
    # ------------------------------------------------------------------ block_pool.py
    M("pool.overdraw", "block_pool.py",
      "        if n > self.num_free_blocks:\n            raise ValueError(",
      "        if False:\n            raise ValueError(",
      POOL, "asking for more blocks than are free raises before taking any"),
    M("pool.evict", "block_pool.py",
      "                del self.cached[b.block_hash]\n                b.block_hash = None\n"
      "                self.num_evictions += 1\n", "                pass\n", POOL,
      "reusing a free cached block evicts its hash"),
    M("pool.touch_free", "block_pool.py",
      "            if b.ref_cnt == 0:\n                self.free_queue.remove(b)\n            b.ref_cnt += 1",
      "            b.ref_cnt += 1", POOL, "a hit on a free cached block takes it out of the free queue"),
    M("pool.double_free", "block_pool.py",
      "            assert b.ref_cnt >= 0, f\"double free of {b}\"\n", "", POOL, "a double free fails loudly"),
    M("pool.free_at_zero", "block_pool.py",
      "            if b.ref_cnt == 0:\n                self.free_queue.append(b)\n",
      "            self.free_queue.append(b)\n", POOL, "a block joins the free queue only when unreferenced"),
    M("pool.cache_off", "block_pool.py",
      "        if not self.enable_caching or b.block_hash is not None:\n            return\n",
      "        if b.block_hash is not None:\n            return\n", POOL, "no hashes at all with caching off"),
    M("pool.cache_rehash", "block_pool.py",
      "        if not self.enable_caching or b.block_hash is not None:\n            return\n",
      "        if not self.enable_caching:\n            return\n", POOL, "a registered block keeps its hash"),
    M("pool.cache_twin", "block_pool.py",
      "        if block_hash in self.cached:\n            return\n", "", POOL,
      "content already cached under another block stays with that block"),
    M("pool.reset_busy", "block_pool.py",
      "        if self.num_free_blocks != self.num_blocks:\n            return False\n", "", POOL,
      "the prefix cache is reset only when no request holds a block"),
    M("pool.pop_empty", "block_pool.py",
      "        if b is self._tail:\n            raise IndexError(\"no free blocks\")\n", "", POOL,
      "popping an empty free queue raises"),
    M("kv.lru_order", "kv_cache_manager.py",
      "        if blocks:\n            self.pool.free_blocks(reversed(blocks))",
      "        if blocks:\n            self.pool.free_blocks(blocks)", POOL,
      "a request's blocks are freed tail-first (its deepest blocks are evicted first)"),
    # ------------------------------------------------------------------ request.py
    M("req.min_tokens", "request.py",
      "        if n_out >= sp.min_tokens:\n", "        if True:\n", STOPS,
      "EOS and stop ids cannot end a request before min_tokens"),
    M("req.ignore_eos", "request.py",
      "            if not sp.ignore_eos and token_id in self.eos_token_ids:",
      "            if token_id in self.eos_token_ids:", STOPS, "ignore_eos"),
    M("req.max_tokens", "request.py",
      "        if n_out >= self.max_tokens:\n", "        if n_out > self.max_tokens:\n", STOPS,
      "a request ends at exactly max_tokens"),
    M("req.child_seed", "request.py",
      "seed=None if sp.seed is None else (sp.seed + i) % _SEED_MOD,", "seed=sp.seed,",
      ["tests/engine/test_sampling_e2e.py"], "sample i of a seeded n > 1 request uses seed + i"),
    M("req.child_prompt_logprobs", "request.py",
      "                prompt_logprobs=sp.prompt_logprobs if i == 0 else None)",
      "                prompt_logprobs=sp.prompt_logprobs)",
      ["tests/engine/test_sampling_e2e.py", "tests/core/test_prefix_caching.py"],
      "only sample 0 computes prompt logprobs (the others can share the prompt's blocks)"),
    # ------------------------------------------------------------------ request_queue.py
    M("queue.fcfs_front", "request_queue.py",
      "    def push_front(self, req: Request) -> None:\n        self._q.appendleft(req)",
      "    def push_front(self, req: Request) -> None:\n        self._q.append(req)", SCHED,
      "fcfs: a preempted request waits at the front"),
    M("queue.fcfs_victim", "request_queue.py",
      "        return running[-1]", "        return running[0]", SCHED,
      "fcfs: the newest running request is the victim"),
    M("queue.aging", "request_queue.py",
      "        aged = (now - req.arrival_time) / self.aging_s if self.aging_s > 0 else 0.0",
      "        aged = 0.0", PRIORITY, "priority: aging (no starvation)"),
    M("queue.strict_outrank", "request_queue.py",
      "        return self.key(waiting, now)[0] < self.key(running, now)[0]",
      "        return self.key(waiting, now)[0] <= self.key(running, now)[0]", PRIORITY,
      "priority: equals never preempt each other (no ping-pong)"),
    M("queue.priority_victim", "request_queue.py",
      "        return max(running, key=lambda r: self.key(r, now))",
      "        return min(running, key=lambda r: self.key(r, now))", PRIORITY,
      "priority: the worst running request is the victim"),
]


MUTANTS += [Mutant(*row, group="wave") for row in WAVE]


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
    print(f"\n| mutant | file | guard | result | first failing test |\n|---|---|---|---|---|")
    for m, status, by, _ in rows:
        print(f"| `{m.id}` | {m.path} | {m.what} | {status} | {by} |")
    print(f"\nscore: {killed}/{len(rows)} killed; survivors: "
          f"{', '.join(m.id for m, s, _, _ in rows if s != 'killed') or 'none'}")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
