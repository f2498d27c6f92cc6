"""The KV-cache manager of a model whose attention layers all slide over one window (Mistral,
Qwen2 with ``use_sliding_window``): a block whose every position has left the window of the
next query goes back to the pool *while the request runs* (vLLM:
single_type_kv_cache_manager.py, SlidingWindowManager.remove_skipped_blocks).

The request's table keeps one entry per logical block; a freed entry becomes :data:`NULL_BLOCK`,
so the worker's append-only table (and each block's position) is unchanged: block ``i`` still
holds positions ``[i*bs, (i+1)*bs)``. The attention layers mask every key outside the window, and
the cache is zeroed at start, so what a freed slot holds later (another request's KV) is read
with weight zero. A query at position ``p`` sees keys ``(p - w, p]``: before a step that starts
at position ``c``, blocks wholly below ``c - w + 1`` are freed. A decoding request then holds at
most ``w / bs + 2`` blocks.

Prefix hits: the hash chain of a block still names its whole prefix, so a hit of ``L`` blocks
needs only the blocks of the window before position ``L * bs`` to be cached; those before it
enter the table as :data:`NULL_BLOCK`.

Models mixing full and sliding layers (Qwen2 with ``max_window_layers``, Gemma 2/3) keep one
table per group, each group one of these managers (core/grouped_kv_cache_manager.py).
"""
from __future__ import annotations

from asyncengine.config.speculative import SpeculativeConfig
from asyncengine.config.sub_configs import KVTransferConfig, SchedulerConfig
from asyncengine.core.block_pool import KVBlock
from asyncengine.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from asyncengine.core.request import Request
from asyncengine.errors import ConfigError


class SlidingWindowKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, sliding_window: int, enable_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        if sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window

    def first_kept_block(self, position: int) -> int:
        """The first block a query at ``position`` (or later) may still read."""
        return max(0, position - self.sliding_window + 1) // self.block_size

    def held_blocks(self, request_id: str) -> int:
        """Pool blocks the request references (its freed, out-of-window entries not counted)."""
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if b is not NULL_BLOCK)

    def remove_skipped_blocks(self, req: Request, position: int) -> None:
        """Free the request's blocks that no query at ``position`` or later reads."""
        blocks = self.req_to_blocks.get(req.request_id)
        if not blocks:
            return
        end = min(self.first_kept_block(position), len(blocks))
        gone = [b for b in blocks[:end] if b is not NULL_BLOCK]
        if gone:
            blocks[:end] = [NULL_BLOCK] * end
            self.pool.free_blocks(reversed(gone))

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest hit of ``L`` blocks whose window blocks (those a query at ``L * bs`` reads)
        are all cached; the blocks before that window enter as NULL_BLOCK."""
        if not self.enable_caching or req.sampling_params.needs_every_prompt_row:
            return [], 0
        n = req.num_tokens
        self._extend_hashes(req, n)
        max_blocks = (n - 1) // self.block_size
        found = [self.pool.get_cached_block(h) for h in req.block_hashes[:max_blocks]]
        run = 0  # cached blocks in a row ending at block i
        runs = []
        for b in found:
            run = run + 1 if b is not None else 0
            runs.append(run)
        for hit in range(max_blocks, 0, -1):
            first = self.first_kept_block(hit * self.block_size)
            if runs[hit - 1] >= hit - first:
                return [NULL_BLOCK] * first + found[first:hit], hit * self.block_size
        return [], 0

    def group_stats(self) -> dict:
        return {"sliding_window": self.sliding_window}


def max_request_len(kv: KVCacheManager, sched: SchedulerConfig, num_blocks: int, model_len: int) -> int:
    """The longest request the cache serves: the whole cache's tokens, or for a sliding-window
    cache under chunked prefill the model's own length, when one chunk plus its window fits."""
    cache_len = num_blocks * kv.block_size
    if not isinstance(kv, SlidingWindowKVCacheManager) or not sched.enable_chunked_prefill:
        return min(model_len, cache_len)
    step_blocks = -(-(sched.max_num_batched_tokens + kv.sliding_window) // kv.block_size) + 2
    return model_len if step_blocks <= num_blocks else min(model_len, cache_len)


def check_sliding_config(speculative: SpeculativeConfig | None, kv_transfer: KVTransferConfig) -> None:
    """Refuse what freeing out-of-window blocks would break, before any worker starts."""
    if speculative is not None:
        raise ConfigError("speculative decoding is not supported with sliding-window KV blocks yet: a draft model "
                          "reads the same block tables with its own attention (maybe beyond the window, into freed "
                          "blocks), and freeing under rejected drafts is untested; leave speculative_config unset")
    if kv_transfer.offload_enabled or kv_transfer.kv_role is not None:
        raise ConfigError("KV offload and P/D disaggregation move whole block tables, and a sliding-window request's "
                          "table has freed blocks: leave kv_offload_bytes, kv_offload_dir and kv_role unset")
