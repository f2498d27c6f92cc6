"""Runner pieces for accelerators that are plain logic, so the CPU tests pin them: the CUDA-graph
capture sizes and the padding of a decode batch to them, the persistent (pinned) input buffers,
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


class PersistentBuffers:
    """Named input buffers allocated once, at their largest: each step fills a prefix of the host
    copy (pinned on CUDA, so the copy to the device is asynchronous) and gets back a view of the
    device copy. No per-step device allocation, and the device tensors keep their addresses, which
    CUDA-graph replay needs.

    Reuse is safe: a buffer's host copy is rewritten only after the event recorded behind its
    previous device copy has passed (free in practice: each step ends by reading its sampled ids
    back, after which that step's copies are done)."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in specs.items():
            h = torch.zeros(shape, dtype=dtype, pin_memory=self.on_cuda)
            self.host[name] = h
            self.dev[name] = torch.zeros(shape, dtype=dtype, device=device) if self.on_cuda else h
        # per buffer: an event after its last host-to-device copy (the host copy is reused after it)
        self._copied = {name: torch.cuda.Event() for name in specs} if self.on_cuda else None

    def capacity(self, name: str) -> int:
        return self.host[name].shape[0]

    def _wait_copies(self, name: str) -> None:
        if self._copied is not None:
            self._copied[name].synchronize()  # at once unless the copy of the last step is pending

    def _host_rows(self, name: str, n: int):
        """The host buffer ``name`` as a numpy array, once it holds ``n`` rows and no copy of the
        previous step still reads it."""
        h = self.host[name]
        if n > h.shape[0]:
            raise ValueError(f"buffer {name!r} holds {h.shape[0]} rows, step needs {n}")
        self._wait_copies(name)
        return h.numpy()

    def stage(self, name: str, values, n: int | None = None, fill: int | float | None = None) -> torch.Tensor:
        """Write ``values`` (a sequence) at the start of buffer ``name``; if ``n`` > len(values),
        rows up to ``n`` get ``fill`` (padding). Returns the device view of the first n rows."""
        m = len(values)
        n = m if n is None else n
        arr = self._host_rows(name, n)
        arr[:m] = values
        if n > m:
            arr[m:n] = 0 if fill is None else fill
        return self._to_device(name, n)

    def stage_rows(self, name: str, rows: list[list[int]], n: int | None = None, fill: int = 0) -> torch.Tensor:
        """A 2-D buffer: row i starts with rows[i] and is padded with ``fill``; rows past len(rows)
        up to ``n`` are all ``fill``. Returns the device view [n, width]."""
        m = len(rows)
        n = m if n is None else n
        arr = self._host_rows(name, n)
        arr[:n] = fill
        width = arr.shape[1]
        for i, r in enumerate(rows):
            if len(r) > width:
                raise ValueError(f"buffer {name!r}: row of {len(r)} > width {width}")
            arr[i, :len(r)] = r
        return self._to_device(name, n)

    def _to_device(self, name: str, n: int) -> torch.Tensor:
        if not self.on_cuda:
            return self.dev[name][:n]
        d = self.dev[name][:n]
        d.copy_(self.host[name][:n], non_blocking=True)
        self._copied[name].record()
        return d


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
