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

from asyncengine.core.block_pool import KVBlock
from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.request import Request
from asyncengine.core.state_slots import StateSlotPool
from asyncengine.errors import ConfigError

log = logging.getLogger(__name__)


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int, state_bytes_per_slot: int) -> None:
        super().__init__(num_blocks, block_size, enable_caching=False)
        self.slots = StateSlotPool(num_state_slots)
        self.state_bytes_per_slot = state_bytes_per_slot

    def state_slot(self, request_id: str) -> int:
        return self.slots.slot_of(request_id)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> list[KVBlock] | None:
        if self.slots.slot_of(req.request_id) < 0 and self.slots.num_free == 0:
            return None
        new = super().allocate_slots(req, num_new_tokens, new_computed_blocks)
        if new is not None:
            self.slots.allocate(req.request_id)
        return new

    def free(self, req: Request) -> None:
        super().free(req)
        self.slots.free(req.request_id)

    def group_stats(self) -> dict:
        return {"num_state_slots": self.slots.num_slots, "num_free_state_slots": self.slots.num_free,
                "state_slot_usage": self.slots.usage,
                "state_cache_bytes": self.slots.num_slots * self.state_bytes_per_slot}


def check_hybrid_config(config, hf_config) -> None:
    """Refuse what hybrid models do not support, before any worker starts."""
    if config.speculative is not None:
        arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
        raise ConfigError(f"speculative decoding is not supported for {arch} (a hybrid model with Mamba2 layers): "
                          "rejected drafts would need the SSM state rolled back to the accepted position; "
                          "leave speculative_config unset")


def make_hybrid_kv_cache_manager(config, hf_config, num_blocks: int, state_bytes_per_seq: int) -> HybridKVCacheManager:
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if config.enable_prefix_caching:
        log.info("prefix caching is off for %s: its Mamba2 layers keep one state per request, with no "
                 "snapshot per block to resume a shared prefix from (docs/hybrid_models.md)", arch)
    log.info("state cache: %d slots (max_num_seqs) of %.2f MiB each, %.1f MiB in all", config.max_num_seqs,
             state_bytes_per_seq / 2**20, config.max_num_seqs * state_bytes_per_seq / 2**20)
    return HybridKVCacheManager(num_blocks, config.block_size, config.max_num_seqs, state_bytes_per_seq)
