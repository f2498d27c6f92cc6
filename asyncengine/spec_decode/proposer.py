"""The one interface the model runner drafts through (vLLM: a proposer per method behind one
``propose``). Two implementations: n-gram prompt lookup (ngram.py, stateless) and a draft model
(draft.py, its own paged KV cache, which must see every position the target computes).

A step hands the proposer its rows as the runner laid them out: ``decodes`` (states computing one
token), ``prefills`` ((state, tokens this step)), ``specs`` ((state, k): rows given k draft slots);
it returns the drafts of each spec row, in order, at most k each. The states are the runner's
per-request states (worker/request_state.py: ``req_id``, ``prompt_ids``, ``output_ids``,
``num_computed_tokens``, ``block_ids``, ``tokens(start, end)``); this module never imports them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

Rows = list[tuple[Any, int]]


class Proposer(ABC):
    # run on every step, drafts or not (a draft model keeps its KV level with the target)
    runs_every_step: bool = False
    # work done, for stats(): positions a draft model ran on, and its forwards (0 for lookups)
    num_tokens_processed: int = 0
    num_forwards: int = 0

    @abstractmethod
    def propose_step(self, decodes: list[Any], prefills: Rows, specs: Rows) -> list[list[int]]:
        """The drafts of each row in ``specs`` (in order; possibly none), before the runner
        advances the rows' computed counts."""

    def add(self, req_id: str, num_computed: int) -> None:
        """A request starts with ``num_computed`` tokens already in the cache (a prefix hit)."""

    def forget(self, req_id: str) -> None:
        """A request finished or was preempted."""

    def reset(self) -> None:
        """Every request was abandoned."""

    def accepted(self, req_id: str, start: int, num_accepted: int, k: int) -> None:
        """The target accepted ``num_accepted`` tokens at a row whose last real token sat at
        ``start`` and which carried ``k`` drafts."""
