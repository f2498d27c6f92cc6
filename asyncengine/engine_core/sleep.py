"""Sleep and wake of an engine core (the worker side: worker/sleep_mode.py).

Level 1 frees the KV cache and the packed weight copies on every rank; level 2 the weights too.
The core must be idle (the front end aborts what runs first) and schedules nothing while any part
sleeps; the prefix cache is reset (its blocks' KV is gone). Waking the weights of level 2 reads the
checkpoint again: a new weights version. A full update_weights while they sleep fills them instead.
"""
from __future__ import annotations

TAGS = ("weights", "kv_cache")


def sleep(core, level: int) -> list[int]:
    """Returns each rank's RSS after."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, not {level}")
    if core.scheduler.has_unfinished() or core.oldest_batch() is not None:
        raise RuntimeError("sleep needs an idle engine core: pause_generation('abort') or finish the requests first")
    core.executor.collective_rpc("reset_requests")  # the runners forget the finished ones too
    rss = core.executor.collective_rpc("sleep", (level,))
    core.asleep |= {"kv_cache"} | ({"weights"} if level == 2 else set())
    core.reset_prefix_cache()
    return rss


def wake_up(core, tags: list[str] | None = None) -> list[int]:
    tags = list(TAGS) if tags is None else list(tags)
    bad = set(tags) - set(TAGS)
    if bad:
        raise ValueError(f"wake_up tags must be among {TAGS}, not {sorted(bad)}")
    rss = core.executor.collective_rpc("wake_up", (tags,))
    if "weights" in tags and "weights" in core.asleep:  # read from the checkpoint again
        core.weights_version += 1
        core.reset_prefix_cache()
    core.asleep -= set(tags)
    return rss

