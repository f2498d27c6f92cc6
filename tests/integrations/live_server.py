"""Live servers for the integration tests: the real app under uvicorn (uvloop) in a background
thread, on 127.0.0.1 and a port the OS picks, around a tiny random-weight llama (fp32).

The fixtures that start them are in conftest.py.
Waits are bounded loops of short sleeps; nothing asserts on wall-clock time.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from asyncengine import AsyncLLMEngine, EngineConfig
from asyncengine.integrations.openai_server import build_app

MODEL = "tiny-llama"
API_KEY = "sk-test-key"
HANG_GUARD_S = 60.0


class LiveServer:
    def __init__(self, engine: AsyncLLMEngine, **app_kw) -> None:
        self.engine = engine
        self.app = build_app(engine, served_model_name=MODEL, **app_kw)
        self.state = self.app.state.server
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(self.app, loop="uvloop", lifespan="on", log_level="warning",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws/chat"

    def start(self) -> "LiveServer":
        self.thread.start()
        for _ in range(int(HANG_GUARD_S / 0.01)):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        raise RuntimeError("the test server did not start in time")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=HANG_GUARD_S)
        self._sock.close()

    # ---- looking at the engine from the test thread, safely (on the server's loop)

    def run(self, coro, wait: bool = True):
        """Run a coroutine on the server's loop; its result (or, wait=False, its future)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.state.loop)
        return fut.result(HANG_GUARD_S) if wait else fut

    def on_loop(self, fn, *args):
        async def call():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(call(), self.state.loop).result(HANG_GUARD_S)

    def stats(self) -> dict:
        return self.on_loop(self.engine.stats)

    def is_clean(self) -> bool:
        e = self.engine
        return self.on_loop(lambda: e.core.kv.num_free_blocks == e.core.num_blocks and not e._slots
                            and e.core.scheduler.num_running == 0 and e.core.scheduler.num_waiting == 0)

    def wait_clean(self, what: str = "the engine to go idle") -> None:
        """Bounded wait until no request holds a block or a stream; fails naming what it waited for."""
        for _ in range(int(HANG_GUARD_S / 0.02)):
            if self.is_clean():
                return
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}: {self.stats()}")


def make_engine(model_dir: str, **kw) -> AsyncLLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("max_model_len", 1024)
    return AsyncLLMEngine(EngineConfig(model=model_dir, dtype="float32", **kw))
