"""Pinned host + device buffers at fixed addresses, filled in place every step: the attention
backend's per-step metadata and the model runner's input ids and positions live in them, so a CUDA
graph captured once replays over whatever a later step staged (worker/cuda_graphs.py). Below the
attention backends (the Triton backend keeps its metadata here) and the worker."""
from __future__ import annotations

import torch


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
