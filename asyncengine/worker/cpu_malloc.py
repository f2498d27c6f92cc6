"""glibc malloc settings for the CPU runner: every step's activations are allocated afresh, so
freed memory is kept for the next step instead of being handed back to the OS and faulted in
again."""
from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt() parameters


def keep_freed_memory() -> bool:
    """Ask glibc malloc to keep freed memory for reuse instead of giving it back to the OS.

    torch's CPU allocator has no cache of its own: every step allocates its activations afresh
    (several MiB each at 2048 tokens) and frees them. By default glibc serves blocks that large
    with fresh mmap()s, or trims the heap as they are freed, so every step pays page faults on
    every large tensor; prefill attention ran at half speed for it (docs/benchmarks.md at c019f6b). With
    these settings the process keeps its peak heap instead (its RSS does not shrink after a burst).
    Process-wide and idempotent; a no-op (False) off glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's maximum: larger blocks still mmap
        return bool(ok and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False
