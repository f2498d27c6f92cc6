"""The KV-cache manager of a hybrid model: two cache groups under one call.

Attention layers keep paged KV blocks (the base :class:`KVCacheManager`); Mamba layers keep one
state slot per request (:class:`StateSlotPool`). ``allocate_slots`` takes a request's blocks *and*
its slot, or neither; ``free`` gives both back; so the scheduler's allocate / preempt / finish /
abort paths cover the state with no change of their own. A pure Mamba2 model has no attention
layers: its blocks then cost no memory and only count the tokens a request may hold.

Prefix caching is off for these models. A cached prefix would need the Mamba state *at the end of
that prefix*: the state after the whole prompt overwrites it in place, so reusing KV blocks needs a
state snapshot per cached block boundary (vLLM's "align"/"all" modes), which costs one full state
per cached block and has had correctness bugs there (docs/hybrid_models.md). Off is exact, and a
log line says so.
"""
from __future__ import annotations

import logging

from asyncengine.config.speculative import SpeculativeConfig
from asyncengine.config.sub_configs import CacheConfig, KVTransferConfig, ParallelConfig, SchedulerConfig
from asyncengine.contracts.kv_cache_spec import KVCacheConfig
from asyncengine.core.block_pool import KVBlock
from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.request import Request
from asyncengine.core.state_slots import StateSlotPool
from asyncengine.errors import ConfigError

log = logging.getLogger(__name__)


class HybridKVCacheManager(KVCacheManager):
    """``n > 1`` forks: sample 0's prompt chunks are cut at its *fork point*, the last block
    boundary before its last prompt token. When it is next scheduled from there, each held sample
    takes a reference on its full blocks before that point, a slot, and a copy of its state (the
    runner copies slot to slot at the start of that step, before the forward moves sample 0 on);
    the sample then computes only the prompt's tail, as it would after a prefix-cache hit."""

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int, state_bytes_per_slot: int) -> None:
        super().__init__(num_blocks, block_size, enable_caching=False)
        self.slots = StateSlotPool(num_state_slots)
        self.state_bytes_per_slot = state_bytes_per_slot
        self._fork_at: dict[str, int] = {}  # sample 0 id -> its fork point (tokens)
        self._forked: dict[str, int] = {}  # forked sample id -> tokens it holds computed
        self._copies: list[tuple[int, int]] = []  # state copies for the step being built

    def state_slot(self, request_id: str) -> int:
        return self.slots.slot_of(request_id)

    # ------------------------------------------------------------------ n > 1 fork

    def plan_fork(self, leader: Request) -> int:
        point = (leader.num_prompt_tokens - 1) // self.block_size * self.block_size
        if point > 0:
            self._fork_at[leader.request_id] = point
        return point

    def fork_point(self, leader: Request) -> int:
        return self._fork_at.get(leader.request_id, 0)

    def cut_chunk(self, req: Request, num_new_tokens: int) -> int:
        point = self._fork_at.get(req.request_id)
        if point and req.num_computed_tokens < point < req.num_computed_tokens + num_new_tokens:
            return point - req.num_computed_tokens
        return num_new_tokens

    def at_fork_point(self, req: Request) -> bool:
        """``req`` is sample 0 of a planned fork, being scheduled on from exactly its fork point."""
        point = self._fork_at.get(req.request_id)
        return point is not None and req.num_computed_tokens == point

    def fork(self, leader: Request, child: Request) -> bool:
        """Give ``child`` the leader's blocks before the fork point, a slot and (at the start of the
        step being built) a copy of the leader's state. False, changing nothing, without a free slot."""
        point = self._fork_at[leader.request_id]
        slot = self.slots.allocate(child.request_id)
        if slot is None:
            return False
        shared = self.req_to_blocks[leader.request_id][:point // self.block_size]
        self.pool.touch(shared)
        self.req_to_blocks[child.request_id] = list(shared)
        self._forked[child.request_id] = point
        self._copies.append((self.slots.slot_of(leader.request_id), slot))
        return True

    def end_fork(self, leader: Request) -> None:
        self._fork_at.pop(leader.request_id, None)

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """A forked sample's tokens before the fork point are computed (its blocks already held)."""
        return [], self._forked.get(req.request_id, 0)

    def take_state_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> list[KVBlock] | None:
        if self.slots.slot_of(req.request_id) < 0 and self.slots.num_free == 0:
            return None
        new = super().allocate_slots(req, num_new_tokens, new_computed_blocks)
        if new is not None:
            self.slots.allocate(req.request_id)
        return new

    def free(self, req: Request) -> None:
        """Blocks and slot; a freed sample 0 plans no fork any more (its held samples are released
        to compute their prompts themselves) and a freed forked sample starts over from zero."""
        super().free(req)
        self.slots.free(req.request_id)
        self._fork_at.pop(req.request_id, None)
        self._forked.pop(req.request_id, None)

    def group_stats(self) -> dict:
        return {"num_state_slots": self.slots.num_slots, "num_free_state_slots": self.slots.num_free,
                "state_slot_usage": self.slots.usage,
                "state_cache_bytes": self.slots.num_slots * self.state_bytes_per_slot}


def check_hybrid_config(speculative: SpeculativeConfig | None, kv_transfer: KVTransferConfig,
                        parallel: ParallelConfig, hf_config) -> None:
    """Refuse what hybrid models do not support, before any worker starts."""
    if speculative is not None:
        arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
        raise ConfigError(f"speculative decoding is not supported for {arch} (a hybrid model with Mamba2 layers): "
                          "rejected drafts would need the SSM state rolled back to the accepted position; "
                          "leave speculative_config unset")
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError("pipeline parallelism is not supported for hybrid models (Mamba2 layers) yet: "
                          "leave pipeline_parallel_size at 1")
    if kv_transfer.offload_enabled or kv_transfer.kv_role is not None:
        arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
        raise ConfigError(f"KV offload and P/D disaggregation move KV blocks only, not the Mamba2 state slots of "
                          f"{arch} (a hybrid model): leave kv_offload_bytes, kv_offload_dir and prefill/decode "
                          "cores unset")


def make_hybrid_kv_cache_manager(plan: KVCacheConfig, cache: CacheConfig, sched: SchedulerConfig, hf_config,
                                 state_bytes_per_seq: int) -> HybridKVCacheManager:
    """One state slot per sequence the scheduler may run (``sched.max_num_seqs``)."""
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if cache.enable_prefix_caching:
        log.info("prefix caching is off for %s: its Mamba2 layers keep one state per request, with no "
                 "snapshot per block to resume a shared prefix from (docs/hybrid_models.md)", arch)
    log.info("state cache: %d slots (max_num_seqs) of %.2f MiB each, %.1f MiB in all", sched.max_num_seqs,
             state_bytes_per_seq / 2**20, sched.max_num_seqs * state_bytes_per_seq / 2**20)
    return HybridKVCacheManager(plan.num_blocks, plan.block_size, sched.max_num_seqs, state_bytes_per_seq)
