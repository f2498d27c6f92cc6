"""What the two sides of a KV connector send each other, once per step (msgspec: the worker may
be another process).

One struct carries the operations of every connector (each fills its own lists).

Scheduler -> worker: :class:`KVConnectorMetadata`, carried by ``SchedulerOutput``. The worker
applies it in this order: ``save_to_host``, ``load_from_host`` and ``stage_from_disk`` before the
forward pass (saves first: a block being evicted may be the target of a load in the same step),
``persist`` after it (those blocks are computed by this very step). Because the worker executes
steps in order, the scheduler may plan step N+1's transfers before step N has run.

Worker -> scheduler: :class:`KVConnectorOutput`, carried by ``ModelRunnerOutput``.
"""
from __future__ import annotations

import msgspec


class StageJob(msgspec.Struct, array_like=True):
    """Read these blocks from the disk tier into these host slots, in the background."""

    job_id: int
    blocks: list[tuple[bytes, int]]  # (block hash, host slot)


class ExportJob(msgspec.Struct, array_like=True):
    """P/D, prefill side: after the forward, hand these blocks (the request's whole prompt) to the
    transport as the transfer of request ``key``."""

    key: str
    block_ids: list[int]
    num_tokens: int
    prompt_digest: bytes


class ImportJob(msgspec.Struct, array_like=True):
    """P/D, decode side: before the forward, copy blocks ``[first, first + len(block_ids))`` of a
    (claimed) transfer file into these blocks, then delete the file."""

    path: str
    first: int
    block_ids: list[int]


class KVConnectorMetadata(msgspec.Struct, kw_only=True):
    save_to_host: list[tuple[int, int]] = []  # (device block id, host slot): blocks being evicted
    load_from_host: list[tuple[int, int]] = []  # (host slot, device block id)
    stage_from_disk: list[StageJob] = []
    persist: list[tuple[int, bytes]] = []  # (device block id, block hash): write to disk after the step
    export: list[ExportJob] = []  # P/D prefill side, after the forward
    import_kv: list[ImportJob] = []  # P/D decode side, before the forward
    # nothing to compute, only transfers in flight: the worker waits briefly for one to finish
    # rather than letting the engine spin on empty steps
    poll: bool = False

    @property
    def is_empty(self) -> bool:
        return not (self.save_to_host or self.load_from_host or self.stage_from_disk or self.persist
                    or self.export or self.import_kv or self.poll)


class StageResult(msgspec.Struct, array_like=True):
    job_id: int
    failed: list[bytes]  # block hashes whose file was missing, foreign or corrupt


class KVConnectorOutput(msgspec.Struct, kw_only=True):
    finished_stages: list[StageResult] = []
    finished_sending: list[str] = []  # finished requests whose held blocks no transfer reads any more
    counters: dict[str, int] = {}  # increments since the last report (bytes moved, bad files...)
