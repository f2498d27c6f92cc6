"""LoRA under tensor parallelism: each rank keeps the slice of every adapter that matches its slice
of the base weights (Megatron's split, as vLLM's column/row-parallel LoRA layers do).

Column-parallel q/k/v/gate/up (output rows split): B is cut by output rows, A stays whole, so the
rank's low-rank product fills exactly its output columns. Row-parallel o/down (input columns
split): A is cut by input columns, B stays whole; each rank's product is a partial sum that the
layer's own all-reduce completes, as it does the base output (the hook runs before it)."""
from __future__ import annotations

from torch import nn

from asyncengine.lora.peft_adapter import LoRAAdapter

_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def full_shapes(model: nn.Module) -> dict[tuple[int, str], tuple[int, int]]:
    """(in, out) per (layer, module) of the whole (unsharded) base model: an adapter is checked
    against these before it is cut, so one trained for another model still fails on every rank."""
    a = model.args
    q, kv, h, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.hidden_size, a.intermediate_size
    per_layer = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                 "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    return {(i, m): s for i in range(len(model.layers)) for m, s in per_layer.items()}


def shard_adapter(adapter: LoRAAdapter, model: nn.Module) -> LoRAAdapter:
    """This rank's slice of ``adapter`` (A [r, in], B [out, r]), cut where ``model.weight_shard``
    cuts the base weight of the same module."""
    weights = {}
    for (layer, module), (a, b) in adapter.weights.items():
        cut = model.weight_shard(f"model.layers.{layer}.{_BLOCK[module]}.{module}.weight")
        if cut is not None:
            dim, start, stop = cut
            if dim == 0:  # column-parallel: this rank's output rows
                b = b[start:stop].contiguous()
            else:  # row-parallel: this rank's input columns
                a = a[:, start:stop].contiguous()
        weights[(layer, module)] = (a, b)
    return LoRAAdapter(name=adapter.name, id=adapter.id, rank=adapter.rank, weights=weights)
