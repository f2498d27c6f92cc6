"""How much host memory the OS says is available now: the KV cache's size on CPU and the packed
dense weights' budget both ask it."""
from __future__ import annotations

import os


def host_available_bytes() -> int | None:
    """Linux ``MemAvailable`` (free + reclaimable); elsewhere the free physical pages; None if neither."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
