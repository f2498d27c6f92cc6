"""The Responses API's store: bounded in number (oldest out first) and in age, size 0 keeps nothing."""
from __future__ import annotations

import pytest

from asyncengine.integrations.openai_server.responses_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_oldest_go_first_past_the_size():
    s = ResponseStore(max_entries=2, ttl_s=100.0)
    for i in range(3):
        s.put(f"r{i}", {"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    assert s.get("r0") is None and len(s) == 2
    assert s.get("r2").response == {"id": "r2"} and s.get("r2").messages[0]["content"] == "2"


def test_entries_expire_after_the_ttl():
    clock = Clock()
    s = ResponseStore(max_entries=10, ttl_s=5.0, clock=clock)
    s.put("a", {}, [])
    clock.now = 3.0
    s.put("b", {}, [])
    clock.now = 5.5
    assert s.get("a") is None and s.get("b") is not None
    clock.now = 8.5
    assert s.get("b") is None and len(s) == 0


def test_delete_and_size_zero():
    s = ResponseStore(max_entries=4)
    s.put("a", {}, [])
    assert s.delete("a") and not s.delete("a") and s.get("a") is None
    none = ResponseStore(max_entries=0)
    none.put("a", {}, [])
    assert none.get("a") is None and len(none) == 0


@pytest.mark.parametrize("size, ttl", [(-1, 10.0), (4, 0.0), (4, float("nan"))])
def test_bad_bounds_are_refused(size, ttl):
    with pytest.raises(ValueError):
        ResponseStore(size, ttl)
