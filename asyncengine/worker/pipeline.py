"""Pipeline parallelism, worker side: what crosses from one stage to the next, and how.

A stage that is not the last ends its forward with the stream's two halves, the last layer's
output and the residual (models/llama.py keeps them apart so that the next norm fuses the add);
they travel as one typed pair, stacked into a single [2, tokens, hidden] tensor per step, by a
point-to-point send (torch.distributed: gloo on CPU, NCCL on CUDA) to the same tensor-parallel rank
of the next stage. Every stage builds the same flat batch from the same SchedulerOutput, so the
receiver knows the token count; sends are asynchronous, so a stage starts its next batch while the
previous one is still on the wire (that is what lets P batches be in the pipe at once).
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

from asyncengine.layers.parallel import PPGroup


class IntermediateTensors(NamedTuple):
    hidden_states: torch.Tensor  # [tokens, hidden]: the last layer's output
    residual: torch.Tensor  # [tokens, hidden]: the stream before it


class StageLink:
    _MAX_PENDING_SENDS = 8  # older sends are waited for beyond this (bounds memory held for the wire)

    def __init__(self, pp: PPGroup, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.pp = pp
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self._sends: deque = deque()  # (work, tensor kept alive until sent)

    def recv(self, num_tokens: int) -> IntermediateTensors:
        """The previous stage's pair for this step (blocks until it arrives)."""
        import torch.distributed as dist

        buf = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(buf, src=self.pp.prev_rank)
        return IntermediateTensors(buf[0], buf[1])

    def send(self, t: IntermediateTensors) -> None:
        """Hand this step's pair to the next stage without waiting for it to be received."""
        import torch.distributed as dist

        while self._sends and (self._sends[0][0].is_completed() or len(self._sends) >= self._MAX_PENDING_SENDS):
            self._sends.popleft()[0].wait()
        buf = torch.stack((t.hidden_states, t.residual)).contiguous()
        self._sends.append((dist.isend(buf, dst=self.pp.next_rank), buf))
