"""Runner pieces for accelerators that are plain logic, so the CPU tests pin them: the CUDA-graph
capture sizes and the padding of a decode batch to them, copies to pinned host lists,
and the KV-cache memory budget from a profiling run."""
from __future__ import annotations

import bisect

import torch

from asyncengine.errors import ConfigError


def capture_sizes(max_num_seqs: int, limit: int = 512) -> list[int]:
    """Decode batch sizes to capture a CUDA graph for: 1, 2, 4, then every multiple of 8, up to
    min(max_num_seqs, limit) (the largest always included). A batch runs in the graph of the
    smallest size that holds it, so padding wastes at most 7 rows past 8."""
    top = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def padded_batch_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n (sizes ascending), or None: too big, run eagerly."""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def kv_cache_budget(total_bytes: int, gpu_memory_utilization: float, peak_bytes: int) -> int:
    """Bytes the KV cache may take: the share of the device the engine may use, less the peak the
    profiling run reached (weights + activations of the largest step + allocator slack).
    vLLM's rule; the caller measures peak_bytes with torch.cuda.max_memory_allocated or similar."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    budget = int(total_bytes * gpu_memory_utilization) - int(peak_bytes)
    if budget <= 0:
        raise ConfigError(
            f"no memory left for the KV cache: {gpu_memory_utilization:.0%} of {total_bytes / 2**30:.2f} GiB "
            f"is {total_bytes * gpu_memory_utilization / 2**30:.2f} GiB, but the model's profiling run already "
            f"peaked at {peak_bytes / 2**30:.2f} GiB; raise gpu_memory_utilization or lower max_num_batched_tokens")
    return budget


def to_host_list(t: torch.Tensor) -> list:
    """A device tensor's values as a Python list. On CUDA: a non-blocking copy into pinned memory
    and a wait on an event recorded after it. The wait releases the GIL (``.tolist()`` on a CUDA
    tensor would hold it through the device sync), so the event loop and the scheduler keep
    running in other threads while the GPU finishes the step; this is the step's only sync."""
    if t.device.type != "cuda":
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()
