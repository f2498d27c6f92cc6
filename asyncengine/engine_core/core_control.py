"""Control calls to an engine core in its own process (data parallel, Ray cores): a trainer's
weight updates, prefix-cache resets, sleep and wake, scheduling pauses.

Rare and small next to the request stream, so one generic message carries them: ``Control`` (an
id, a method of :data:`METHODS`, pickled arguments; a weight update's tensors ride in it) and
``ControlResult`` (the same id, the pickled result or the error). The core process answers each in
its loop, between two turns of its step pipeline; :class:`PendingCalls` matches answers to the
futures the front end awaits.
"""
from __future__ import annotations

import itertools
import pickle
import threading
from concurrent.futures import Future

import msgspec

from asyncengine.errors import EngineDeadError, WeightUpdateError


class Control(msgspec.Struct, tag="control"):
    call_id: int
    method: str
    payload: bytes  # pickle of the argument tuple


class ControlResult(msgspec.Struct, tag="control_result"):
    call_id: int
    payload: bytes = b""  # pickle of the result
    error: str | None = None
    error_type: str = ""


def _stage(core, update):
    from asyncengine.engine_core import weight_sync  # lazy: weight updates and sleep: loaded on first use

    return weight_sync.stage(core, update)


def _commit(core):
    from asyncengine.engine_core import weight_sync  # lazy: weight updates and sleep: loaded on first use

    weight_sync.commit(core).result()
    return core.weights_version


def _discard(core):
    from asyncengine.engine_core import weight_sync  # lazy: weight updates and sleep: loaded on first use

    weight_sync.discard(core)


def _sleep(core, level):
    from concurrent.futures import wait

    while core.oldest_batch() is not None:  # the last batches of requests the front end aborted
        wait([core.oldest_batch()])
        core.finish_oldest_batch(refill=False)
    return core.sleep(level)


# what a front end may ask of a core process, by name
METHODS = {
    "stage_weights": _stage,
    "commit_weights": _commit,
    "discard_weights": _discard,
    "reset_prefix_cache": lambda core: core.reset_prefix_cache(),
    "weights_version": lambda core: core.weights_version,
    # the core process sends the batches still in flight before it answers (engine_core/core_proc.py)
    "pause_scheduling": lambda core: setattr(core, "scheduling_paused", True),
    "resume_scheduling": lambda core: setattr(core, "scheduling_paused", False),
    "sleep": _sleep,
    "wake_up": lambda core, tags: core.wake_up(tags),
    "asleep": lambda core: sorted(core.asleep),
}

_ERRORS = {"WeightUpdateError": WeightUpdateError, "ValueError": ValueError}


def run_control(core, msg: Control) -> ControlResult:
    """Run one call on ``core`` (in the core process's loop); its error travels back as text."""
    fn = METHODS.get(msg.method)
    try:
        if fn is None:
            raise ValueError(f"unknown control call {msg.method!r}")
        result = fn(core, *pickle.loads(msg.payload))
        return ControlResult(call_id=msg.call_id, payload=pickle.dumps(result))
    except Exception as e:
        return ControlResult(call_id=msg.call_id, error=str(e), error_type=type(e).__name__)


class PendingCalls:
    """The front end's side: futures by call id, resolved by the core's reader thread."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waiting: dict[int, Future] = {}

    def new(self, method: str, args: tuple) -> tuple[Control, Future]:
        fut: Future = Future()
        with self._lock:
            call_id = next(self._ids)
            self._waiting[call_id] = fut
        return Control(call_id=call_id, method=method, payload=pickle.dumps(args)), fut

    def resolve(self, msg: ControlResult) -> None:
        with self._lock:
            fut = self._waiting.pop(msg.call_id, None)
        if fut is None:
            return
        if msg.error is None:
            fut.set_result(pickle.loads(msg.payload))
        else:
            fut.set_exception(_ERRORS.get(msg.error_type, RuntimeError)(msg.error))

    def fail_all(self, why: str) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            fut.set_exception(EngineDeadError(why))


# ---------------------------------------------------------------------------------- front end side


async def call_all(cores, method: str, *args) -> list:
    """``method`` on every core given (EngineCoreProc handles), awaited together; the first
    error raises once all have answered."""
    import asyncio

    results = await asyncio.gather(*(asyncio.wrap_future(c.call(method, *args)) for c in cores),
                                   return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


async def update_all(cores, update) -> int:
    """Stage ``update`` on every core (each on all its ranks) before committing on any; a refusal
    anywhere discards it everywhere. Returns the cores' new version."""
    try:
        await call_all(cores, "stage_weights", update)
    except BaseException:
        try:
            await call_all(cores, "discard_weights")
        except Exception:  # a core that died meanwhile holds nothing
            pass
        raise
    return max(await call_all(cores, "commit_weights"))
