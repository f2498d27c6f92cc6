"""pause_generation / resume_generation of the async engine (engine/async_engine.py), for a
trainer that updates the weights between rollouts.

While paused the busy loop holds new requests (engine/busy_loop.py: within the admission limits)
instead of handing them to the core. What happens to the requests the core already has is the
mode's: aborted, finished, or parked with their KV (the core schedules nothing:
``EngineCore.scheduling_paused``, on every core of a data-parallel engine).
"""
from __future__ import annotations

import asyncio

MODES = ("abort", "wait", "keep")
_POLL_S = 0.002


def _at_core(engine) -> list[str]:
    """The live streams whose requests reached the core (not those held or still being prepared)."""
    held = {r.request_id for r in engine._busy_loop.new}
    live = engine.output_processor.is_live
    return [rid for rid in engine._slots if rid not in held and live(rid)]


async def _until_ended(engine, ids: list[str]) -> None:
    slots = engine._slots
    while any(rid in slots for rid in ids):
        await asyncio.sleep(_POLL_S)


async def pause(engine, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"pause_generation mode must be one of {', '.join(MODES)}, not {mode!r}")
    busy = engine._busy_loop
    busy.paused = True
    ids = _at_core(engine)
    if mode == "abort":
        for rid in ids:
            engine._abort_nowait(rid)
        await _until_ended(engine, ids)
    elif mode == "wait":
        await _until_ended(engine, ids)
    else:
        await engine.client.pause_scheduling()


async def resume(engine) -> None:
    busy = engine._busy_loop
    await engine.client.resume_scheduling()
    busy.paused = False
    if busy.wake is not None:
        busy.wake.set()
