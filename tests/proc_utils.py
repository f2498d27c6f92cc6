"""Process helpers for the tests that check no engine-core or worker process is left behind."""
from __future__ import annotations

import os


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (by parent pid, via /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if rest[0] != "Z":
                children.setdefault(int(rest[1]), []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out
