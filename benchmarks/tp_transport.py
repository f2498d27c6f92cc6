"""Per-step cost of the mp executor's transport: a SchedulerOutput of B decode requests encoded
once with msgspec, written to the pipes of N worker processes, decoded there; rank 0 answers with
a ModelRunnerOutput of B ids, decoded by the parent. No model runs: this is the overhead a step
pays for crossing processes. Compared with the same over a Unix socket pair, and with pickle.

    python benchmarks/tp_transport.py --ranks 2 --batch 1,256 --steps 2000
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import platform
import socket
import struct
import time

from asyncengine.contracts.sched_output import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from asyncengine.executor import messages as M


def make_step(batch: int, step: int) -> SchedulerOutput:
    cached = [CachedRequestData(req_id=f"req-{i:08x}", new_block_ids=[step] if i % 16 == 0 else [],
                                num_computed_tokens=100 + step) for i in range(batch)]
    return SchedulerOutput(new_requests=[], cached_requests=cached,
                           num_scheduled_tokens={c.req_id: 1 for c in cached},
                           total_num_scheduled_tokens=batch, finished_req_ids=[])


class SockConn:
    """A socket with the Connection interface we need (length-prefixed messages)."""

    def __init__(self, s: socket.socket) -> None:
        self.s = s

    def send_bytes(self, b: bytes) -> None:
        self.s.sendall(struct.pack("<I", len(b)) + b)

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.s.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    def recv_bytes(self) -> bytes:
        (n,) = struct.unpack("<I", self._exact(4))
        return self._exact(n)


def echo_worker(conn, rank: int, codec: str) -> None:
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        if codec == "msgspec":
            msg = M.decode_request(data)
            if isinstance(msg, M.Shutdown):
                return
            so = msg.scheduler_output
        else:
            so = pickle.loads(data)
            if so is None:
                return
        if rank == 0:
            out = ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens), sampled_token_ids=[[7]] * len(so.num_scheduled_tokens))
            conn.send_bytes(M.encode(M.StepResult(output=out)) if codec == "msgspec" else pickle.dumps(out))


def run(kind: str, codec: str, ranks: int, batch: int, steps: int) -> float:
    ctx = mp.get_context("spawn")
    parents, procs = [], []
    for r in range(ranks):
        if kind == "pipe":
            a, b = ctx.Pipe()
        else:
            sa, sb = socket.socketpair()
            a, b = SockConn(sa), SockConn(sb)
        p = ctx.Process(target=echo_worker, args=(b, r, codec), daemon=True)
        p.start()
        parents.append(a)
        procs.append(p)
    sos = [make_step(batch, i) for i in range(16)]
    for i in range(steps + 200):
        if i == 200:
            t0 = time.perf_counter()
        so = sos[i % 16]
        data = M.encode(M.ExecuteModel(so)) if codec == "msgspec" else pickle.dumps(so)
        for c in parents:
            c.send_bytes(data)
        reply = parents[0].recv_bytes()
        out = M.decode_reply(reply).output if codec == "msgspec" else pickle.loads(reply)
        assert len(out.req_ids) == batch
    dt = (time.perf_counter() - t0) / steps
    for c in parents:
        c.send_bytes(M.encode(M.Shutdown()) if codec == "msgspec" else pickle.dumps(None))
    for p in procs:
        p.join(5)
    return dt * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", default="1,256")
    ap.add_argument("--steps", type=int, default=2000)
    a = ap.parse_args()
    res = {"cpu": platform.processor() or platform.machine(), "ranks": a.ranks, "steps": a.steps, "us_per_step": {}}
    for batch in map(int, a.batch.split(",")):
        for kind, codec in (("pipe", "msgspec"), ("socket", "msgspec"), ("pipe", "pickle")):
            us = run(kind, codec, a.ranks, batch, a.steps)
            res["us_per_step"][f"{kind}+{codec} B={batch}"] = round(us, 1)
            print(f"{kind:6s} {codec:7s} B={batch:4d}: {us:8.1f} us/step", flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
