"""Functions the tests send to workers through ``collective_rpc`` (they run on every rank, with the
worker as first argument): fault injection and looks at what a worker holds. Module-level so that
worker processes (spawned) can import them by name."""
from __future__ import annotations

import itertools
import os
import time


def fail_after(worker, n: int, message: str = "simulated kernel fault", rank: int | None = None,
               once: bool = False) -> None:
    """Steps after ``n`` more raise RuntimeError (only the first of them with ``once``; on
    ``rank`` only, if given)."""
    if rank is not None and worker.rank != rank:
        return
    runner = worker.runner
    real = runner.execute
    calls = {"n": 0}

    def faulty(so):
        calls["n"] += 1
        if calls["n"] > n and not (once and calls["n"] > n + 1):
            raise RuntimeError(message)
        return real(so)

    runner.execute = faulty


def break_forward(worker, message: str = "forward exploded") -> None:
    def boom(*a, **k):
        raise ValueError(message)

    worker.model.forward = boom


def slow_steps(worker, seconds: float) -> None:
    runner = worker.runner
    real = runner.execute

    def slow(so):
        time.sleep(seconds)
        return real(so)

    runner.execute = slow


def die_after(worker, n: int, rank: int) -> None:
    """Rank ``rank`` kills its own process (no exception, no goodbye) at its (n+1)th step."""
    if worker.rank != rank:
        return
    runner = worker.runner
    real = runner.execute
    calls = {"n": 0}

    def dying(so):
        calls["n"] += 1
        if calls["n"] > n:
            os._exit(17)
        return real(so)

    runner.execute = dying


def model_facts(worker) -> dict:
    m = worker.model
    return {"lm_head_is_none": m.lm_head is None,
            "rope_type": m.rotary.params.get("rope_type"),
            "param_dtypes": sorted({str(p.dtype) for p in m.parameters()})}


def attention_windows(worker) -> list:
    """Each layer's attention sliding window (None: full attention)."""
    return [layer.self_attn.sliding_window for layer in worker.model.layers]


def attention_kernels(worker) -> bool:
    """Whether the cpu backend attends in its C kernels (False: it fell back to the torch path)."""
    return bool(getattr(worker.runner.attn_backend, "kernels", False))


def runner_of(worker):
    """The worker's model runner (in-process executors only: the object itself comes back)."""
    return worker.runner


def restore_execute(worker) -> None:
    """Undo fail_after / slow_steps / die_after."""
    worker.runner.__dict__.pop("execute", None)


def hook_forward(worker, hook) -> None:
    """Call ``hook(k)`` before the k-th (0, 1, ...) forward pass of this worker's model (see
    model_utils.model_hook); undone by unhook_forward."""
    model = worker.model
    inner = model.forward
    calls = itertools.count()

    def forward(*args, **kwargs):
        hook(next(calls))
        return inner(*args, **kwargs)

    model.forward = forward


def unhook_forward(worker) -> None:
    worker.model.__dict__.pop("forward", None)  # the class's forward again


def moe_local_experts(worker) -> list[int]:
    """How many experts each MoE layer of this rank holds (expert parallel: 1/N of them)."""
    return [m.w13.shape[0] for m in worker.model.modules() if hasattr(m, "w13")]
