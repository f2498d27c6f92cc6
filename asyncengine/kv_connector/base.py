"""The KV-connector seam, after vLLM's ``KVConnectorBase_V1``: one object on the scheduler side
(decides, keeps indexes, never touches tensors) and one on the worker side (moves bytes).

Scheduler side, called by ``core/scheduler.py`` while a step is built:

* ``get_num_new_matched_tokens(req, num_computed)`` when a waiting request is looked at: how many
  prompt tokens after its device prefix-cache hit can come from outside, and whether they arrive
  asynchronously. Async: the request leaves the waiting queue and holds neither a sequence slot nor
  KV blocks until ``update_connector_output`` says its transfer finished; then it is looked at again.
  Sync: those tokens count as computed, and their blocks are filled before this step's forward.
* ``update_state_after_alloc(req, blocks, num_computed, num_external)`` once blocks are allocated.
* ``build_meta(scheduled, requests)`` at the end of ``schedule()``: this step's
  :class:`KVConnectorMetadata`.
* ``update_connector_output(out)`` with what the worker reported; returns the ids of requests whose
  asynchronous load ended (successfully or not: a failed block is simply computed), and of finished
  requests whose blocks a transfer no longer reads.
* ``request_finished(req)`` when a request leaves the engine (finished, aborted): drop its state,
  and return None (free its blocks now) or a lease in seconds: the blocks stay allocated until the
  connector reports them sent or the lease runs out (``lease_expired``: fail the transfer).

Worker side, called by ``worker/model_runner.py`` around each step: ``before_forward(meta)``,
``after_forward(meta)``, ``take_output()``; ``close()`` at shutdown (flush pending writes).

No connector configured = ``None`` on both sides and not one extra call per step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from asyncengine.contracts.connector_messages import KVConnectorMetadata, KVConnectorOutput

if TYPE_CHECKING:
    from asyncengine.core.block_pool import KVBlock
    from asyncengine.core.request import Request


class SchedulerConnector(ABC):
    @abstractmethod
    def get_num_new_matched_tokens(self, req: "Request", num_computed: int) -> tuple[int, bool]:
        """(external tokens, load asynchronously). Must leave at least the last prompt token to
        compute, and count whole blocks only. Without side effects when it answers synchronously
        (the request may not get its blocks and be looked at again next step)."""

    @abstractmethod
    def update_state_after_alloc(self, req: "Request", blocks: list["KVBlock"], num_computed: int,
                                 num_external: int) -> None:
        """``blocks`` is the request's whole block table; the external tokens are
        ``[num_computed, num_computed + num_external)``."""

    @abstractmethod
    def build_meta(self, scheduled: dict[str, int], requests: dict[str, "Request"]) -> KVConnectorMetadata | None:
        """This step's transfers (None: nothing). ``scheduled``: request id -> tokens this step
        (their ``num_computed_tokens`` already counts them); empty: an idle step."""

    @abstractmethod
    def update_connector_output(self, out: KVConnectorOutput) -> tuple[list[str], list[str]]:
        """Fold the worker's report in; returns (ids whose asynchronous load ended, ids whose held
        blocks may be freed)."""

    @abstractmethod
    def request_finished(self, req: "Request") -> float | None:
        """The request is gone (``req.status`` says how): release whatever it pinned. None: free
        its blocks now; seconds: hold them under a lease of that length."""

    def lease_expired(self, request_id: str) -> None:
        """A lease ran out before the transfer was reported done: its blocks are freed already."""

    def has_pending_transfers(self) -> bool:
        """Transfers the worker has not reported yet (the engine keeps stepping until it has)."""
        return False

    def stats(self) -> dict:
        return {}


class WorkerConnector(ABC):
    @abstractmethod
    def before_forward(self, meta: KVConnectorMetadata | None) -> None: ...

    @abstractmethod
    def after_forward(self, meta: KVConnectorMetadata | None) -> None: ...

    @abstractmethod
    def take_output(self) -> KVConnectorOutput | None:
        """What happened since the last call (None: nothing)."""

    def serving_address(self) -> str | None:
        """The ``host:port`` this worker serves transfers on, as bound (None: it serves none)."""
        return None

    def close(self) -> None:
        """Finish pending writes (a clean shutdown keeps what was computed)."""
