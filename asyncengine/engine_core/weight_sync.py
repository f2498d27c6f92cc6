"""Weight updates seen from an engine core: stage on every rank, then commit, or refuse on all.

Why two phases: a rank that applied half an update while another refused it would serve a
mixture; so every rank first checks the whole update (worker/weight_update.py: names, this rank's
slice's shapes, dtypes, completeness) through the executor's ``collective_rpc`` and keeps it; only
when all of them answer cleanly does the commit go out, as one more control call queued behind the
steps already handed to the executor. The core bumps its ``weights_version`` and resets the prefix
cache at the moment it queues the commit, so every batch scheduled after it is stamped with the new
version and runs after the new weights are in (the executor runs calls in order).

A data-parallel front end stages on every core before it commits on any (engine/core_client.py).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from asyncengine.errors import WeightUpdateError

if TYPE_CHECKING:  # (``core`` below: an engine_core/core.py EngineCore, which imports this module)
    from asyncengine.worker.weight_update import WeightUpdate


def normalize(weights, partial: bool = False) -> "WeightUpdate":
    """What ``update_weights`` accepts (a path, a state_dict, (name, tensor) pairs) as the one
    message every rank gets; a WeightUpdateError for anything else."""
    from asyncengine.worker.weight_update import normalize as to_update  # lazy: the worker's weight code loads only for an update

    try:
        return to_update(weights, partial)
    except ValueError as e:
        raise WeightUpdateError(str(e)) from None


def stage(core, update: "WeightUpdate") -> int:
    """Every rank checks and keeps ``update``; returns how many tensors the ranks took. Raises
    WeightUpdateError (every rank dropping what it kept) when any rank refuses it, or when a name
    has a place on no rank. Blocking; safe off the thread that steps the core."""
    results = core.executor.collective_rpc("stage_weight_update", (update,))
    errors = [f"rank {r.rank}: {r.error}" if len(results) > 1 else r.error for r in results if r.error]
    if not errors:
        nowhere = set.intersection(*(set(r.unclaimed) for r in results))
        if nowhere:
            errors.append(f"no such tensor in the model: {sorted(nowhere)[:3]}")
        elif sum(r.num_tensors for r in results) == 0:
            errors.append("none of the tensors belongs to the model")
    if errors:
        core.executor.collective_rpc("discard_weight_update")
        raise WeightUpdateError(f"update_weights refused, the weights are unchanged: {'; '.join(errors)}")
    return sum(r.num_tensors for r in results)


def commit(core) -> Future:
    """Queue the staged update on every rank (after the steps in flight) and move the core to the
    next version: the future of the ranks' results. Call on the thread that schedules the core."""
    fut = core.executor.collective_rpc("commit_weight_update", non_block=True)
    core.weights_version += 1
    core.asleep.discard("weights")  # a full update fills weights that slept (worker/sleep_mode.py)
    core.reset_prefix_cache()
    return fut


def discard(core) -> None:
    core.executor.collective_rpc("discard_weight_update")


def update_blocking(core, weights, partial: bool = False) -> int:
    """Stage and commit on a core this thread drives (the offline LLM, a core process); returns
    the new version."""
    from asyncengine.worker.weight_update import WeightUpdate  # lazy: the worker's weight code loads only for an update

    update = weights if isinstance(weights, WeightUpdate) else normalize(weights, partial)
    stage(core, update)
    commit(core).result()
    return core.weights_version
