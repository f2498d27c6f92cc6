"""The engine's busy loop: the one task on the app's event loop that hands inputs to the core client
and routes each finished batch it gives back, and the inputs waiting for its next turn.

Kept apart from AsyncLLMEngine (engine/async_engine.py), which binds it to a loop, submits requests
into it and answers the public API. It talks to one ``CoreClient`` (engine/core_client.py),
wherever the core runs; the stepping itself (a queue of in-flight batches: the next one is
scheduled and queued before this one's outputs are detokenized and routed) is the engine core's
(engine_core/core.py); with the core in this process the client awaits the batch's future on this loop.
"""
from __future__ import annotations

import asyncio
import logging

from asyncengine.core.request import Request
from asyncengine.engine.core_client import CoreClient
from asyncengine.engine.stream_router import StreamRouter
from asyncengine.errors import EngineDeadError

log = logging.getLogger(__name__)

_HEALTH_CHECK_S = 1.0  # an idle busy loop checks the core's health this often


class BusyLoop:
    def __init__(self, client: CoreClient, router: StreamRouter) -> None:
        self.client = client
        self.router = router
        self.new: list[Request] = []  # submitted, handed to the core at the next turn
        self.aborts: set[str] = set()  # request ids to abort at the next turn
        self.task: asyncio.Task | None = None
        self.wake: asyncio.Event | None = None  # set when an input (or a remote core's output) arrives
        self.dead: EngineDeadError | None = None  # why the loop died (the engine is unusable)
        self.closing = False  # shutdown began: the loop returns once nothing is left
        # pause_generation: new requests wait here (within the admission limits) until resumed
        self.paused = False

    @property
    def is_running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run on ``loop`` (a fresh wake event: the old one belongs to the old loop)."""
        self.wake = asyncio.Event()
        wake_event = self.wake

        def wake() -> None:  # from any thread (a remote core's reader)
            try:
                loop.call_soon_threadsafe(wake_event.set)
            except RuntimeError:  # the loop is closed
                pass
        self.client.bind(wake, self.drain_inputs)
        self.task = loop.create_task(self.run(), name="asyncengine-busy-loop")

    def drain_inputs(self) -> None:
        core = self.client
        if self.new and self.paused:  # held; only those abandoned meanwhile leave
            self.new = [r for r in self.new if r.request_id not in self.aborts]
        elif self.new:
            new, self.new = self.new, []
            for req in new:
                if req.request_id in self.aborts:
                    continue  # abandoned before it reached the core
                try:
                    core.add_request(req)
                except EngineDeadError:  # not this request's fault: no core is left, the loop dies
                    raise
                except Exception as e:  # this request's input: it alone fails
                    self.router.fail_request(req.request_id, e, "was admitted")
        if self.aborts:
            ids, self.aborts = list(self.aborts), set()
            core.abort_requests(ids)
            for rid in ids:
                self.router.end_aborted(rid)

    async def run(self) -> None:
        """Hand the inputs to the core client and route each finished batch it gives back; with
        nothing to wait for, sleep until an input (or a remote core's output) arrives, looking at
        the core's health now and then (a dead worker kills the engine now, not at the next
        request)."""
        client = self.client
        try:
            while True:
                self.drain_inputs()
                batch = await client.get_output()
                if batch is not None:
                    await self.router.route(batch)
                    continue
                if self.closing and not self.new and not self.router.slots and client.is_idle():
                    return
                self.wake.clear()
                if (self.new and not self.paused) or self.aborts:
                    continue
                # work that cannot be scheduled now (never with a sane config) is retried soon
                timeout = _HEALTH_CHECK_S if client.is_idle() else 0.01
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=timeout)
                except asyncio.TimeoutError:
                    client.check_health()
        except asyncio.CancelledError:
            # the loop is going away (asyncio.run cancels every task it leaves behind): end this
            # loop's requests but keep the engine usable from the next loop. Batches already handed
            # to the executor still run there: their blocks are already in the prefix cache.
            if self.task is asyncio.current_task():
                self.abandon_all()
            raise
        except GeneratorExit:
            # the coroutine is being destroyed with its closed loop (the engine has moved on to
            # another loop, or is garbage): not a fault, and that loop can no longer be touched
            raise
        except BaseException as e:  # a model fault: every waiter learns why, nobody hangs
            dead = EngineDeadError(f"the engine died: {type(e).__name__}: {e}")
            dead.__cause__ = e
            log.exception("asyncengine busy loop died")
            self.dead = dead
            self.router.fail_all(dead)
            self.new.clear()
            raise dead from e

    def abandon_all(self) -> None:
        """End every request of the loop the engine leaves (its streams get an "abort" output) and
        empty the core, so that the next loop starts clean."""
        self.router.abandon_all()
        self.client.abort_all()  # the workers forget them once the batches already queued are done
        self.new.clear()
        self.aborts.clear()
