"""The parent's side of one grammar-compile worker process (compile_worker.py): start it, send
it a job, read its answer within a CPU budget while watching for cancellation, and tell when it
is worn (too many compiles or too much memory kept) so that the service replaces it."""
from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time

import msgspec

from asyncengine.structured import compile_worker as cw

WORKER_START_TIMEOUT_S = 120.0  # a bound only: a worker starts in ~0.3-2 s (its imports, the tokenizer info)
_POLL_S = 0.05  # how soon a cancelled or overdue compile notices
WALL_FACTOR = 4  # a compile's wall-clock backstop, in multiples of its CPU budget
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
WORKER_MAX_COMPILES = 500  # then a fresh worker: what its allocator kept is returned
WORKER_MAX_RSS = 256 << 20  # bytes; a worker past it is replaced after its compile (~55 MB at start)


class Cancelled(Exception):
    pass


class Overdue(Exception):
    pass


class Worker:
    """One compile worker process and the pipe to it."""

    def __init__(self, tokenizer_info: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "asyncengine.structured.compile_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(cw.FromWorker)
        self.ready = False
        self.compiles = 0
        self._send(cw.Hello(tokenizer_info))  # the pipe buffers it while the child imports

    def worn(self) -> bool:
        """Time to replace it: too many compiles behind it, or too much memory kept."""
        if self.compiles >= WORKER_MAX_COMPILES:
            return True
        rss = cw.rss_bytes(self.proc.pid)
        return rss is not None and rss > WORKER_MAX_RSS

    def _send(self, msg) -> None:
        body = self._enc.encode(msg)
        self.proc.stdin.write(cw._HEADER.pack(len(body)) + body)
        self.proc.stdin.flush()

    def _read_exact(self, n: int, overdue, cancel: threading.Event | None) -> bytes:
        fd = self.proc.stdout.fileno()
        buf = bytearray()
        while len(buf) < n:
            if cancel is not None and cancel.is_set():
                raise Cancelled
            if overdue():
                raise Overdue
            r, _, _ = select.select([fd], [], [], _POLL_S)
            if r:
                chunk = os.read(fd, n - len(buf))
                if not chunk:
                    raise EOFError(f"the grammar compile worker exited ({self.proc.poll()})")
                buf += chunk
        return bytes(buf)

    def _recv(self, overdue, cancel: threading.Event | None):
        (size,) = cw._HEADER.unpack(self._read_exact(cw._HEADER.size, overdue, cancel))
        return self._dec.decode(self._read_exact(size, overdue, cancel))

    def cpu_s(self) -> float | None:
        """CPU seconds the worker has used (Linux /proc; None elsewhere)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _TICKS
        except (OSError, IndexError, ValueError):
            return None

    def wait_ready(self, cancel: threading.Event) -> None:
        if not self.ready:
            deadline = time.monotonic() + WORKER_START_TIMEOUT_S
            try:
                msg = self._recv(lambda: time.monotonic() > deadline, cancel)
            except Overdue:
                raise OSError(f"the grammar compile worker did not start in {WORKER_START_TIMEOUT_S:.0f} s") from None
            assert isinstance(msg, cw.Ready), msg
            self.ready = True

    def compile(self, kind: str, text: str, budget_s: float, cancel: threading.Event) -> cw.Result:
        """The budget is the worker's CPU time (a compile starved by a busy host, at nice 10, is
        not the client's fault), with ``WALL_FACTOR`` x of wall time as the backstop."""
        cpu0 = self.cpu_s()
        wall = time.monotonic() + WALL_FACTOR * budget_s
        self._send(cw.Job(kind, text))
        self.compiles += 1

        def overdue() -> bool:
            if time.monotonic() > wall:
                return True
            cpu = self.cpu_s() if cpu0 is not None else None
            return cpu is not None and cpu - cpu0 > budget_s

        return self._recv(overdue, cancel)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
