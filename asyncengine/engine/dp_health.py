"""Which data-parallel engine cores are alive, and what a core's death costs: only its own requests.

Before, one core's death killed the engine (every stream on every core failed, and the server
answered 500 for ever; issue 27). Now the front end (engine/core_client.py: ``MPClient``)
marks the core dead, fails the requests it owned (``EngineCoreDied``), and routes new requests to
the cores left, by giving a dead core a load no live one can reach (the router, engine/dp_router.py,
then never picks it: neither least loaded, nor within its affinity slack). The engine is dead only
when no core is left. ``restart_dead_cores``: a dead core is replaced by a fresh process (it loads
the model again: seconds), and counts as alive once that one is ready.
"""
from __future__ import annotations

import threading

DEAD_LOAD = 1 << 62  # a dead core's load as the router sees it


class CoreHealth:
    """The alive / dead / restarting state of ``num_cores`` cores (thread-safe: reader threads
    report deaths, the event loop routes, a restart thread revives)."""

    def __init__(self, num_cores: int) -> None:
        self.num_cores = num_cores
        self._dead: set[int] = set()
        self._lock = threading.Lock()
        self.deaths = 0
        self.restarts = 0

    @property
    def num_alive(self) -> int:
        return self.num_cores - len(self._dead)

    def is_alive(self, index: int) -> bool:
        return index not in self._dead

    def mark_dead(self, index: int) -> bool:
        """True the first time ``index`` is reported dead (a core's death arrives once from its
        reader thread, and may also be seen by a health check)."""
        with self._lock:
            if index in self._dead:
                return False
            self._dead.add(index)
            self.deaths += 1
            return True

    def mark_alive(self, index: int) -> None:
        with self._lock:
            if index in self._dead:
                self._dead.discard(index)
                self.restarts += 1

    def loads(self, loads: list[int]) -> list[int]:
        """The router's view: a dead core's load is out of reach."""
        dead = self._dead
        return [DEAD_LOAD if i in dead else v for i, v in enumerate(loads)]

    def summary(self) -> dict:
        return {"cores": self.num_cores, "alive": self.num_alive, "dead": sorted(self._dead),
                "deaths": self.deaths, "restarts": self.restarts}


def requests_of(owner: dict[str, int], index: int) -> list[str]:
    """Remove and return the request ids ``owner`` (request id -> core index) gives to ``index``."""
    lost = [rid for rid, i in owner.items() if i == index]
    for rid in lost:
        del owner[rid]
    return lost
