"""The cycle collector around a model load.

A full collection walks every object the collector tracks; once torch is imported there are about a
million, and a load allocates enough to trigger three full collections of 15-90 ms each (0.2-0.25 s
of a one-line chat's start on 2 cores, measured with ``gc.callbacks``). So the collector is paused
while an engine loads, and what exists after the load is frozen (``gc.freeze``): later collections,
mid-serving, skip it (a full one had stalled the event loop ~185 ms; docs/benchmarks.md). Both under
``EngineConfig.freeze_gc_after_load``. Nothing is lost by the pause: cyclic garbage made meanwhile
is found by the next collection after it.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import threading

_lock = threading.Lock()
_pauses = 0  # nested or concurrent loads: the collector resumes after the last one
_resume = False  # whether it was enabled when the first pause began (an app may have disabled it)
_unfreeze_registered = False


@contextlib.contextmanager
def paused(enabled: bool = True):
    """Pause the cycle collector for the block (if ``enabled``); re-enable it after the last of
    overlapping pauses, unless it was off before the first."""
    global _pauses, _resume
    if not enabled:
        yield
        return
    with _lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _resume:
                gc.enable()


def freeze_after_load() -> None:
    """gc.freeze(), undone at interpreter exit so that extension modules' objects are still
    released normally then. No gc.collect() first: after a load it found nothing to free (0 of 180k
    objects on the default model) and took 0.1 s of the start."""
    global _unfreeze_registered
    gc.freeze()
    with _lock:
        if not _unfreeze_registered:
            atexit.register(gc.unfreeze)
            _unfreeze_registered = True
