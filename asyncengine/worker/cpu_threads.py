"""Intra-op CPU threads that make room for the rest of the machine.

Why: a decode step of a small model runs a few hundred short parallel regions, and each ends at a
barrier that waits for the slowest thread. While the cores are free, two threads beat one (~1.4x on
2 cores). But when another process keeps a core busy, one of our threads is descheduled at most
barriers and every region waits for it: with one core busy elsewhere the default model decoded at
14 tok/s on two threads against 41 on one (docs/benchmarks.md, "Single-stream decode": the thread governor). An
engine embedded in someone else's app shares the machine, so the worker watches how much CPU the
*other* processes used over the last half second (``/proc/stat`` minus this process's own CPU time)
and runs with the cores they leave: at least one, at most the count it started with. A change
needs the same answer twice in a row, so a short burst elsewhere does not flip it.

It runs only where it can measure (Linux) and where nothing pinned the count: ``num_threads``
given, or several tensor-parallel ranks sharing the cores, turn it off.
"""
from __future__ import annotations

import math
import os
import time
from typing import Callable

CpuTimes = tuple[float, float]  # (seconds the whole machine was busy, seconds this process ran)


def read_cpu_times() -> CpuTimes | None:
    """Busy CPU seconds of the machine since boot (all cores) and of this process; None where
    ``/proc/stat`` is missing."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu":
        return None
    ticks = [int(v) for v in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    busy = sum(ticks[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is in user)
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


def cores_left(other_busy_cores: float, num_cpus: int, max_threads: int) -> int:
    """Threads to run with when other processes keep ``other_busy_cores`` cores busy: the whole
    cores they leave (a core at least half free counts), within [1, max_threads]."""
    return max(1, min(max_threads, math.floor(num_cpus - other_busy_cores + 0.5)))


class ThreadGovernor:
    """Call :meth:`update` before each step, on the thread that runs the model; it returns a new
    thread count when one should be set (``torch.set_num_threads``), else None."""

    def __init__(self, max_threads: int, num_cpus: int | None = None, interval_s: float = 0.5,
                 read: Callable[[], CpuTimes | None] = read_cpu_times,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self.num_cpus = num_cpus or len(os.sched_getaffinity(0))
        self.interval_s = interval_s
        self._read, self._clock = read, clock
        self._last = (clock(), read())
        self._pending: int | None = None

    @property
    def enabled(self) -> bool:
        return self._last[1] is not None and self.max_threads > 1

    def update(self) -> int | None:
        if not self.enabled:
            return None
        now = self._clock()
        t0, before = self._last
        if now - t0 < self.interval_s:
            return None
        after = self._read()
        if after is None:
            return None
        self._last = (now, after)
        other = max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / (now - t0)
        want = cores_left(other, self.num_cpus, self.max_threads)
        if want == self.threads:
            self._pending = None
            return None
        if self._pending != want:  # once is a burst; twice in a row is the machine
            self._pending = want
            return None
        self._pending = None
        self.threads = want
        return want
