"""The soak's server: ``asyncengine serve``'s app under uvicorn + uvloop in a child process, with a
heartbeat on its loop (the loop lag) and, on request, a probe of its own memory (malloc's view, the
Python heap, threads) so that the soak can say *where* RSS grew, not only that it did.

The client talks to the child through files in its temporary folder: ``reset-lag`` (start a fresh
lag record after the warm-up) and ``probe`` (write ``probe.json`` with :func:`memory_probe`).
``/proc/PID/smaps_rollup`` is read by the client itself (:func:`smaps_rollup`).
"""
from __future__ import annotations

import asyncio
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

HANG_GUARD_S = 120.0
HEARTBEAT_S = 0.01
MODEL_NAME = "soak"
SOAK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "soak.py")


# ---------------------------------------------------------------- memory probes


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_stats() -> dict:
    """glibc malloc's own figures for this process (MiB): the heap it holds in all arenas, what is
    in use, what is free inside it, mmapped blocks, and how many arenas (heaps) exist."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        mi = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    out = {"arena_mb": mi.arena / 2**20, "in_use_mb": mi.uordblks / 2**20, "free_mb": mi.fordblks / 2**20,
           "mmapped_mb": mi.hblkhd / 2**20}
    try:  # malloc_info's XML lists one <heap nr=...> per arena
        libc.open_memstream.restype = ctypes.c_void_p
        buf, size = ctypes.c_char_p(), ctypes.c_size_t()
        stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        libc.malloc_info(0, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        xml = ctypes.string_at(buf, size.value).decode()
        libc.free(buf)
        out["arenas"] = len(re.findall(r"<heap nr=", xml))
    except (OSError, AttributeError):
        pass
    return out


def memory_probe() -> dict:
    """What the server process holds, by owner: malloc (C/C++: torch, oneDNN), Python's object heap."""
    return {**malloc_stats(), "python_blocks": sys.getallocatedblocks(), "threads": len(os.listdir("/proc/self/task"))}


def smaps_rollup(pid: int) -> dict:
    """/proc/PID/smaps_rollup in MiB (Rss, Anonymous, Private_Dirty, ...)."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) / 1024
    except OSError:
        pass
    return out


# ---------------------------------------------------------------- the server (the child)


async def serve(args) -> None:
    import uvicorn

    from asyncengine import AsyncLLMEngine, EngineConfig
    from asyncengine.integrations.openai_server import build_app

    engine = AsyncLLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                                         num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs))
    app = build_app(engine, served_model_name=MODEL_NAME, own_engine=True)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=5))
    loop = asyncio.get_running_loop()
    lags: list[float] = []

    async def heartbeat() -> None:
        while True:
            t = loop.time()
            await asyncio.sleep(HEARTBEAT_S)
            lags.append(loop.time() - t - HEARTBEAT_S)
            if len(lags) > 2_000_000:
                del lags[:1_000_000]

    hb = asyncio.create_task(heartbeat())
    folder = os.path.dirname(args.stats)
    reset, probe = os.path.join(folder, "reset-lag"), os.path.join(folder, "probe")

    async def requests_from_client() -> None:  # the client's file-drop requests (module docstring)
        while True:
            await asyncio.sleep(0.1)
            if os.path.exists(reset):
                os.unlink(reset)
                lags.clear()
            if os.path.exists(probe):
                tmp = os.path.join(folder, "probe.json.tmp")
                with open(tmp, "w") as f:
                    json.dump(memory_probe(), f)
                os.replace(tmp, os.path.join(folder, "probe.json"))
                os.unlink(probe)

    rs = asyncio.create_task(requests_from_client())
    try:
        await server.serve()
    finally:
        hb.cancel()
        rs.cancel()
        xs = sorted(lags)
        p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")
        with open(args.stats, "w") as f:
            json.dump({"lag_p99_ms": p99 * 1e3, "lag_max_ms": (xs[-1] if xs else float("nan")) * 1e3,
                       "lag_samples": len(xs)}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python benchmarks/soak.py --serve ...`` as a child; stop() returns its loop-lag figures.
    ``env``: extra environment for the child (e.g. ONEDNN_VERBOSE=profile_create to count the
    oneDNN primitives it creates: :meth:`onednn_creations`)."""

    def __init__(self, model: str, max_model_len: int = 256, num_kv_blocks: int = 256, max_num_seqs: int = 64,
                 dtype: str = "float32", env: dict | None = None) -> None:
        self.port = _free_port()
        self.dir = tempfile.mkdtemp(prefix="soak-")
        self.stats = os.path.join(self.dir, "stats.json")
        self.log_path = os.path.join(self.dir, "server.log")
        self.log = open(self.log_path, "w+")
        self.env = dict(env or {})
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **self.env}
        self.proc = subprocess.Popen(
            [sys.executable, SOAK_SCRIPT, "--serve", "--model", model, "--port", str(self.port),
             "--stats", self.stats, "--max-model-len", str(max_model_len), "--num-kv-blocks", str(num_kv_blocks),
             "--max-num-seqs", str(max_num_seqs), "--dtype", dtype], stdout=self.log, stderr=subprocess.STDOUT,
            env=env)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        import httpx

        for _ in range(int(HANG_GUARD_S / 0.1)):
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.log.seek(0)
        raise RuntimeError(f"the soak server did not start:\n{self.log.read()[-3000:]}")

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def probe(self) -> dict:
        """The child's :func:`memory_probe` plus its smaps_rollup (bounded wait; {} if it does not answer)."""
        out = os.path.join(self.dir, "probe.json")
        if os.path.exists(out):
            os.unlink(out)
        open(os.path.join(self.dir, "probe"), "w").close()
        for _ in range(100):
            if os.path.exists(out):
                with open(out) as f:
                    return {**json.load(f), "smaps": smaps_rollup(self.proc.pid)}
            time.sleep(0.05)
        return {"smaps": smaps_rollup(self.proc.pid)}

    def onednn_creations(self) -> dict:
        """oneDNN primitives created so far, by its verbose log (needs ONEDNN_VERBOSE=profile_create)."""
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            lines = [ln for ln in f if ln.startswith("onednn_verbose") and ",create:" in ln]
        return {"created": len(lines), "cache_miss": sum(",create:cache_miss," in ln for ln in lines)}

    def reset_lag(self) -> None:
        open(os.path.join(self.dir, "reset-lag"), "w").close()

    def stop(self) -> dict:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        try:
            with open(self.stats) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}
