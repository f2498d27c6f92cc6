"""A trainer's controls on the engine core(s), as each core client implements them: weight
updates (engine_core/weight_sync.py: staged on every rank of every core, then committed on all),
prefix-cache resets and the scheduling pause of ``pause_generation("keep")``. Mixed into the clients of engine/core_client.py.

In-process, the ranks check an update on a worker thread (the event loop stays free, steps go on)
and the commit is queued from the loop that schedules the core, so no batch is scheduled between
the version's bump and the commit; with cores in their own processes each core does the same in
its loop when the front end's control calls reach it (engine_core/core_control.py).
"""
from __future__ import annotations

import asyncio


class InprocControls:
    """For ``InprocClient``: ``self.core`` is the EngineCore in this process."""

    @property
    def weights_version(self) -> int:
        return self.core.weights_version

    async def update_weights(self, update) -> int:
        from asyncengine.engine_core import weight_sync  # lazy: the front end imports no torch: core code loads only where it runs here

        await asyncio.to_thread(weight_sync.stage, self.core, update)  # the ranks check it, off the loop
        fut = weight_sync.commit(self.core)  # from the loop that schedules: no batch slips in between
        await asyncio.shield(asyncio.wrap_future(fut))  # never cancelled once queued
        return self.core.weights_version

    async def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    async def pause_scheduling(self) -> None:
        """Schedule nothing new (the requests keep their KV); returns once the batches in flight
        are done (the busy loop routes their outputs)."""
        self.core.scheduling_paused = True
        while self.core.oldest_batch() is not None:
            await asyncio.sleep(0.002)

    async def resume_scheduling(self) -> None:
        self.core.scheduling_paused = False

    @property
    def asleep(self) -> set[str]:
        return self.core.asleep

    async def sleep(self, level: int) -> list[int]:
        while self.core.has_work():  # the batches of the requests just aborted
            await asyncio.sleep(0.002)
        return await asyncio.to_thread(self.core.sleep, level)

    async def wake_up(self, tags: list[str] | None) -> list[int]:
        return await asyncio.to_thread(self.core.wake_up, tags)


class MPControls:
    """For ``MPClient``: ``self.clients`` are EngineCoreProc handles, ``self.health`` says which live."""

    weights_version: int = 0

    def live_cores(self) -> list:
        return [c for i, c in enumerate(self.clients) if self.health.is_alive(i)]

    async def update_weights(self, update) -> int:
        from asyncengine.engine_core.core_control import update_all  # lazy: the front end imports no torch: core code loads only where it runs here

        self.weights_version = await update_all(self.live_cores(), update)
        self.asleep = self.asleep - {"weights"}
        return self.weights_version

    async def reset_prefix_cache(self) -> None:
        await self._call_all("reset_prefix_cache")

    async def pause_scheduling(self) -> None:
        await self._call_all("pause_scheduling")  # each core answers once its batches in flight are sent

    async def resume_scheduling(self) -> None:
        await self._call_all("resume_scheduling")

    asleep: set[str] = set()

    async def sleep(self, level: int) -> list[int]:
        rss = [r for core in await self._call_all("sleep", level) for r in core]
        self.asleep = {"kv_cache"} | ({"weights"} if level == 2 else set()) | self.asleep
        return rss

    async def wake_up(self, tags: list[str] | None) -> list[int]:
        rss = [r for core in await self._call_all("wake_up", tags) for r in core]
        self.asleep = set((await self._call_all("asleep"))[0])
        return rss

    async def _call_all(self, method: str, *args) -> list:
        from asyncengine.engine_core.core_control import call_all  # lazy: the front end imports no torch: core code loads only where it runs here

        return await call_all(self.live_cores(), method, *args)
