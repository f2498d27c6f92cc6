"""Per-group block tables on the worker, for models mixing full and sliding-window layers (Gemma 2/3,
Qwen2 with ``max_window_layers``): the core keeps one table per KV-cache group
(core/grouped_kv_cache_manager.py), and each attention layer must read its own group's.

The cache: ``contracts.kv_cache_spec.block_table_groups`` cuts the layers into groups of ``size``
layers; the runner allocates ``size`` (k, v) tensors and gives layer ``j`` of every group tensor
``j`` (vLLM's hybrid allocator shares a page between groups the same way), so a pool block is
``size`` layers' memory and each group's ids address it through its own layers only.

The step: the runner lays out the flat batch once (group 0's table gives its slots), then builds
one attention metadata per group from the same rows with that group's table. Models are not
touched: each layer's cache is a :class:`GroupKV` (a (k, v) tuple that knows its group), and the
step's metadata is a :class:`GroupedMeta` whose ``backend.forward`` hands the layer's own group's
metadata to the real backend. The native decode step and CUDA graphs take one table only: the
runner runs without them for these models (logged). Speculative decoding, KV offload, P/D and
pipeline parallelism keep one table with every block instead (``kv_cache_spec.one_table_reason``).
"""
from __future__ import annotations

from asyncengine.attention.backend import SeqChunk, StepBatch
from asyncengine.contracts.kv_cache_spec import KVCacheGroup, table_groups


class GroupKV(tuple):
    """One layer's ``(k_cache, v_cache)``, with the KV-cache group whose table it reads."""

    def __new__(cls, k, v, group: int):
        t = super().__new__(cls, (k, v))
        t.group = group
        return t


def groups_of(model, one_table: str | None) -> list[KVCacheGroup]:
    """The engine's block tables over this model's layers (the core decides the same way);
    ``one_table``: why the engine keeps one table (``kv_cache_spec.one_table_reason``; None: per group)."""
    return table_groups(getattr(model.args, "layer_windows", ()), one_table)


def layers_per_block(groups: list[KVCacheGroup]) -> int | None:
    """The cache tensors one block spans with several tables (None: every layer's)."""
    return max(len(g.layers) for g in groups) if len(groups) > 1 else None


def allocate_kv_caches(backend, groups: list[KVCacheGroup], num_layers: int, alloc) -> list:
    """The runner's cache: one (k, v) per layer, or with several groups one :class:`GroupKV` per
    layer, layer ``j`` of each group on the shared tensor pair ``j``."""
    if len(groups) <= 1:
        return backend.allocate_kv_caches(num_layers, alloc)
    tensors = backend.allocate_kv_caches(layers_per_block(groups), alloc)
    caches: list[GroupKV | None] = [None] * num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            caches[layer] = GroupKV(*tensors[j], g)
    return caches


class GroupedMeta:
    """A step's attention metadata per group; to a model it is the metadata and its ``backend``."""

    def __init__(self, metas: list) -> None:
        self.metas = metas
        self.backend = self

    @property
    def scale(self) -> float:
        return self.metas[0].backend.scale

    def forward(self, q, k, v, kv_cache: GroupKV, meta, sliding_window: int | None = None, **kwargs):
        m = self.metas[kv_cache.group]
        return m.backend.forward(q, k, v, kv_cache, m, sliding_window, **kwargs)


def grouped_metadata(backend, lay, states, block_size: int) -> GroupedMeta:
    """One metadata per group over the step's rows (``states``: each of ``lay.seqs``' request, in
    order); group 0's slots are the layout's own."""
    metas = [backend.build_metadata(StepBatch(seqs=lay.seqs, slot_mapping=lay.slots, num_decodes=lay.num_decodes))]
    bs = block_size
    for g in range(len(states[0].group_block_ids) if states else 0):
        seqs, slots = [], []
        for st, s in zip(states, lay.seqs):
            table = st.group_block_ids[g]
            seqs.append(SeqChunk(query_start=s.query_start, query_len=s.query_len, context_len=s.context_len,
                                 block_ids=table))
            a = s.query_start
            slots.extend(table[p // bs] * bs + p % bs for p in lay.positions[a:a + s.query_len])
        metas.append(backend.build_metadata(StepBatch(seqs=seqs, slot_mapping=slots, num_decodes=lay.num_decodes)))
    return GroupedMeta(metas)
