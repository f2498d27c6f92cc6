"""The image encoder's share of a step (vLLM V1's encoder compute budget): how many placeholder
rows of images that are not encoded yet one step may reach.

The worker encodes an image whole, in the step whose chunk first reaches any row of its placeholder
run (worker/encoder_cache.py), so a step's encoder work is the run lengths of the images its chunks
reach that are not encoded yet. The scheduler passes each chunk through :meth:`EncoderBudget.fit`:
the images the chunk newly reaches are taken, in prompt order, while they fit what is left of the
step's ``max_tokens``; the first that does not ends the chunk just before its placeholder run, and
the image waits for a later step (whose budget starts afresh). A chunk may still end *inside* a run
for the token budget's sake: the worker slices the encoder output by rows and the next chunk resumes.

No deadlock: an image larger than the whole budget goes in a step that has encoded nothing else
(it runs alone). Without chunked prefill a prompt is scheduled whole or not at all, its images
likewise (all of them may go together in a step that has encoded nothing else).

"Encoded already" needs no mirror of the worker's cache: the worker keeps an image's output while a
request that started its run has not passed it, so an image is held when a running request's
computed count lies inside its run (that request's chunk reached it in an earlier step: the counts
advance when a step is scheduled) or when this step already took it. Outputs the worker keeps
beyond that (its least-recently-used tail) are counted as new work again: the budget bounds the
encoder's work from above.
"""
from __future__ import annotations

from asyncengine.contracts.multimodal import MultiModalInput
from asyncengine.core.request import Request


class EncoderBudget:
    def __init__(self, max_tokens: int, running: list[Request], *, chunked: bool = True) -> None:
        """``running``: the scheduler's own list of running requests (read, never changed)."""
        if max_tokens < 1:
            raise ValueError(f"the encoder budget must be >= 1 token, got {max_tokens}")
        self.max_tokens, self.running, self.chunked = max_tokens, running, chunked
        self.used = 0  # encoder rows taken by this step so far
        self.taken: set[str] = set()  # hashes of the images this step encodes
        self.deferred: set[str] = set()  # requests whose chunk this step stopped before an image
        self.num_tokens = 0  # encoder rows taken, all steps (an upper bound of the worker's work)

    def begin_step(self) -> None:
        self.used = 0
        self.taken.clear()
        self.deferred.clear()

    def _held(self, m: MultiModalInput) -> bool:
        if m.hash in self.taken:
            return True
        for r in self.running:
            if r.mm_inputs and r.num_computed_tokens > 0:
                for o in r.mm_inputs:
                    if o.hash == m.hash and o.offset < r.num_computed_tokens < o.end:
                        return True
        return False

    def fit(self, req: Request, start: int, n: int) -> int:
        """The tokens of ``req`` from prompt position ``start`` this step computes: ``n``, or fewer
        so that the images they newly reach fit what is left of the step's budget (0: none now).
        The images taken are charged to the step."""
        if not req.mm_inputs or n <= 0:
            return n
        stop = start + n
        new: dict[str, MultiModalInput] = {}  # hash -> its first run in the chunk
        for m in sorted(req.mm_inputs, key=lambda m: m.offset):
            if m.offset < stop and start < m.end and m.hash not in new and not self._held(m):
                new[m.hash] = m
        if not new:
            return n
        if not self.chunked:  # the whole prompt or nothing
            cost = sum(m.length for m in new.values())
            if self.used and self.used + cost > self.max_tokens:
                self.deferred.add(req.request_id)
                return 0
            self._take(new.values())
            return n
        take = []
        used = self.used
        for m in new.values():
            if used and used + m.length > self.max_tokens:  # (nothing taken yet: it goes alone)
                n = max(m.offset - start, 0)
                self.deferred.add(req.request_id)
                break
            used += m.length
            take.append(m)
        self._take(take)
        return n

    def _take(self, images) -> None:
        for m in images:
            self.used += m.length
            self.num_tokens += m.length
            self.taken.add(m.hash)
