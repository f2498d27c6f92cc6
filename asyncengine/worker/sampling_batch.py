"""The sampler's view of the running batch, kept across steps (vLLM V1's persistent InputBatch /
SamplingMetadata idea).

Why: most steps sample the same requests as the step before. Their per-row tables (temperature,
top-k, top-p, min-p, allowed ids, biases, logprob rows: :meth:`SamplingMetadata.build_static`) are
built when the batch's rows change and reused while they do not; a step then touches only the rows
that need per-step work (seeded draws, ``min_tokens`` and bad-word bans, penalties, whose token ids
live on the device: worker/penalty_history.py). A plain greedy batch costs one comparison of the
rows' ids. The result is, field for field, what :meth:`SamplingMetadata.build` makes from the lists.
"""
from __future__ import annotations

from typing import Sequence

import torch

from asyncengine.worker.penalty_history import PenaltyHistory
from asyncengine.worker.request_state import RunnerRequestState
from asyncengine.worker.sampling_metadata import SamplingMetadata

__all__ = ["SamplingBatch"]


class _Column:
    """``column[i]`` is ``getattr(states[i], name)``, read only for the rows that ask."""

    __slots__ = ("states", "name")

    def __init__(self, states: Sequence[RunnerRequestState], name: str) -> None:
        self.states, self.name = states, name

    def __getitem__(self, i: int):
        return getattr(self.states[i], self.name)

    def __len__(self) -> int:
        return len(self.states)


class SamplingBatch:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device,
                 generator: torch.Generator | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        self.generator = generator
        self.history = PenaltyHistory(vocab_size, device)
        self._key: tuple[str, ...] | None = None  # the rows (request ids) of the static tables
        self._static: SamplingMetadata | None = None
        self.num_rebuilds = 0  # how often the rows changed (tests, stats)

    def forget(self, req_id: str) -> None:
        """A request left (finished, or re-sent as a new one): drop its history and, if it was
        in the batch, the static tables."""
        self.history.forget(req_id)
        if self._key is not None and req_id in self._key:
            self._key = self._static = None

    def clear(self) -> None:
        self.history.clear()
        self._key = self._static = None

    def metadata(self, states: Sequence[RunnerRequestState]) -> SamplingMetadata:
        """This step's metadata for ``states`` (one sampled row each, after its ``output_ids``)."""
        key = tuple([st.req_id for st in states])
        if key != self._key:
            self._static = SamplingMetadata.build_static(
                [st.sampling_params for st in states], [st.bad_words_token_ids for st in states],
                self.eos_token_ids, self.vocab_size, self.device, self.generator)
            self._key = key
            self.num_rebuilds += 1
        outputs = _Column(states, "output_ids")
        return self._static.for_step(outputs, lambda meta: self.history.fill(
            meta, key, _Column(states, "prompt_ids"), outputs))
