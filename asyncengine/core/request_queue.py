"""Waiting queues, one per scheduling policy. The scheduler only peeks, pops, and pushes back."""
from __future__ import annotations

import time
from collections import deque

from asyncengine.core.request import Request


class FCFSQueue:
    """First come, first served; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def push_front(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)

    def pick_victim(self, running: list[Request]) -> Request:
        """The newest running request loses its blocks first."""
        return running[-1]


class PriorityQueue:
    """Lower ``priority`` runs first, ties by arrival.

    Aging prevents starvation: a request's effective priority improves by one level for every
    ``aging_s`` seconds since it *arrived* (running or waiting), so any request eventually outranks
    a stream of newer high-priority arrivals, both for admission and for keeping its blocks.
    Because every request ages at the same rate, an older request never falls behind a younger
    one of the same base priority, which rules out preemption ping-pong."""

    def __init__(self, aging_s: float = 10.0, clock=time.monotonic) -> None:
        self.aging_s = aging_s
        self.clock = clock
        self._q: list[Request] = []

    def key(self, req: Request, now: float) -> tuple[float, float]:
        aged = (now - req.arrival_time) / self.aging_s if self.aging_s > 0 else 0.0
        return (req.priority - int(aged), req.arrival_time)

    def add(self, req: Request) -> None:
        self._q.append(req)

    push_front = add  # position is decided by the key, not by insertion order

    def peek(self) -> Request:
        now = self.clock()
        return min(self._q, key=lambda r: self.key(r, now))

    def pop(self) -> Request:
        r = self.peek()
        self._q.remove(r)
        return r

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)

    def pick_victim(self, running: list[Request]) -> Request:
        """The running request with the worst effective (aged) priority, newest first."""
        now = self.clock()
        return max(running, key=lambda r: self.key(r, now))

    def outranks(self, waiting: Request, running: Request) -> bool:
        """May ``waiting`` take ``running``'s place? Only with a strictly better effective
        priority: equals never preempt each other."""
        now = self.clock()
        return self.key(waiting, now)[0] < self.key(running, now)[0]


def make_queue(policy: str, aging_s: float = 10.0):
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue(aging_s)
    raise ValueError(f"unknown scheduling policy {policy!r}")
