"""Process helpers for the tests that check no engine-core or worker process is left behind."""
from __future__ import annotations

import os
import time


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


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return
        time.sleep(0.1)
    raise AssertionError(f"worker processes still alive: {[p for p in pids if alive(p)]}")


async def drain_after_core_death(streams, owners: list[int], dead: int, num_tokens: int) -> None:
    """Data parallel degrades: each stream owned by core ``dead`` fails with EngineCoreDied, every
    other one finishes with ``num_tokens`` tokens (engine/dp_health.py)."""
    import asyncio

    import pytest

    from asyncengine import EngineCoreDied

    async def drain(st, dies: bool) -> None:
        if dies:
            with pytest.raises(EngineCoreDied):
                async for _ in st:
                    pass
            return
        async for out in st:
            pass
        assert out.finished and len(out.outputs[0].token_ids) == num_tokens

    await asyncio.gather(*(drain(st, o == dead) for st, o in zip(streams, owners)))
