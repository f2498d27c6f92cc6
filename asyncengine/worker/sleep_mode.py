"""Sleep and wake on one rank: give the KV cache (level 1) and the weights (level 2) back to the
OS while a trainer uses the memory, and take them back after.

"Back to the OS" is the point, so what counts is the process's RSS, not a pool counter: the
tensors are dropped (every reference: the runner's list, the native step's layer table), then
glibc is asked to return its free pages (``malloc_trim``; large tensors were mmap()ed and go back
as they are freed). The packed copies of dense weights (oneDNN's layout: as large as the weights)
go at level 1 too and are rebuilt at wake. Level 2 drops the model itself; ``wake_up(["weights"])``
reads the checkpoint again, or a full ``update_weights`` fills fresh storage instead.

Sleep needs an idle runner (the core aborts or finishes every request first) and refuses what
holds KV elsewhere (a KV connector, a draft model's cache).
"""
from __future__ import annotations

import ctypes
import gc
import sys

from asyncengine.attention.kv_cache import kv_cache_zeros
from asyncengine.errors import ConfigError
from asyncengine.worker.kv_groups import allocate_kv_caches

TAGS = ("weights", "kv_cache")


def rss_bytes() -> int:
    """This process's resident set size (Linux: /proc/self/statm), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return 0


def trim() -> None:
    """Collect, then hand glibc's free memory back to the OS (and CUDA's cached blocks to the device)."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):
            pass


def _forget_native_table(model) -> None:
    step = getattr(model, "native_step", None) if model is not None else None
    if step is not None:  # its tables point into the KV tensors (and the LoRA slots)
        step.forget()


def sleep(worker, level: int) -> int:
    runner = worker.runner
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, not {level}")
    if runner.kv_connector is not None or runner.proposer is not None:
        raise ConfigError("sleep is not available with a KV connector or speculative decoding")
    if runner.requests:
        raise RuntimeError(f"sleep with {len(runner.requests)} requests in the runner")
    _forget_native_table(worker.model)
    runner.kv_caches = None
    runner.state_cache = None
    if worker.model is not None:
        from asyncengine.layers.linear import Linear  # lazy: only on this path (loading, profiling, a configuration)

        for m in worker.model.modules():
            if isinstance(m, Linear) and m.onednn_weight is not None:
                m.onednn_weight = None
                worker.repack_on_wake = True
    if level == 2:
        worker.model = runner.model = None
        worker.weights_dropped = True  # until a checkpoint read or a full update fills them
    trim()
    return rss_bytes()


def wake_up(worker, tags: list[str]) -> int:
    bad = set(tags) - set(TAGS)
    if bad:
        raise ValueError(f"wake_up tags must be among {TAGS}, not {sorted(bad)}")
    runner = worker.runner
    if "weights" in tags and worker.weights_dropped:
        worker.model = runner.model = None
        trim()
        worker.load_model()  # the checkpoint again, packed as at load
        _reattach(worker)
        worker.weights_dropped = False
    if worker.model is not None and not worker.weights_dropped and getattr(worker, "repack_on_wake", False):
        _repack(worker)  # the same packed copies as before: the same bits
        worker.repack_on_wake = False
    if "kv_cache" in tags and runner.kv_caches is None:
        allocate_kv(runner)
    return rss_bytes()


def _reattach(worker) -> None:
    """A model loaded again: the runner's, and the LoRA hooks and slots (kept, adapters and all) on it."""
    worker.runner.model = worker.model
    if getattr(worker.runner, "lora", None) is not None:
        worker.runner.lora.attach(worker.model)


def _repack(worker) -> None:
    if not worker.config.batch_invariant and worker.config.torch_device.type == "cpu":
        from asyncengine.layers import packed_linear  # lazy: sleep, weight updates and hybrid models: loaded on first use

        packed_linear.prepack(worker.model)


def allocate_kv(runner) -> None:
    """The cache (and a hybrid's state slots) as ModelRunner built them, zeroed."""
    from asyncengine.worker.state_cache import StateCache  # lazy: sleep, weight updates and hybrid models: loaded on first use

    model = runner.model
    n = model.args.num_layers if runner.pp.size == 1 else len(model.layers)
    runner.kv_caches = allocate_kv_caches(runner.attn_backend, runner.kv_groups, n, kv_cache_zeros)
    runner.state_cache = StateCache.for_model(model, runner.scheduler_config.max_num_seqs, runner.dtype, runner.device)


def weights_for_update(worker, update) -> None:
    """Before staging an update: weights dropped by sleep(level=2) get fresh, unread storage,
    which only a full update may fill."""
    if not worker.weights_dropped:
        return
    if update.partial:
        raise ValueError("the weights were dropped by sleep(level=2): update them all (partial=False) "
                         "or wake_up(['weights']) first")
    if worker.model is None:
        worker.load_model(read_weights=False)
        _reattach(worker)

