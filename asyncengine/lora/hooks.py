"""LoRA on a Llama-shaped model (Llama, Mistral, Qwen2, Qwen3: ``model.layers[i].self_attn.qkv_proj``
...): forward hooks on its four linear layers per decoder layer add each adapter's low-rank product
to that adapter's rows, grouped. The model's own code is unchanged. The native C decode step
(models/llama_native.py) runs no module, so no hook: it reads the same slot stacks through
``model.lora`` and this step's slot per row (:attr:`LoRAModel.native_rows`) and adds the products
in C (kernels/cpu/lora.c). The hooks call that same C loop on CPU fp32 (one call per projection
over every adapter's rows; torch ops cost ~55 us of dispatch per adapter and projection), and the
torch apply of grouped.py elsewhere (GPU, bf16, tensor parallel).

Under tensor parallelism each rank holds its slice of every adapter (sharding.py); not yet under
pipeline parallelism."""
from __future__ import annotations

import torch
from torch import nn

from asyncengine.errors import ConfigError
from asyncengine.kernels.cpu import lora as cpu_lora
from asyncengine.lora.grouped import RowGroups, add_lora, row_groups
from asyncengine.lora.peft_adapter import LoRAAdapter, load_peft_adapter
from asyncengine.lora.sharding import full_shapes, shard_adapter
from asyncengine.lora.slots import LinearSlots, LoRASlots

# Steps up to this many rows add their adapters with lora.c's loop (decode-sized: dispatch is the
# cost there); longer prefill chunks' products are matmul-sized, where torch's GEMM is faster
C_LOOP_MAX_ROWS = 64

# (block, fused layer, the PEFT modules fused into it, in their output order)
FUSED = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("self_attn", "o_proj", ("o_proj",)),
         ("mlp", "gate_up_proj", ("gate_proj", "up_proj")), ("mlp", "down_proj", ("down_proj",)))


class LoRAModel:
    """The adapters of one model: load/unload (host LRU), and per step :meth:`set_rows`."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if getattr(getattr(model, "pp", None), "size", 1) > 1:
            raise ConfigError("LoRA adapters do not run under pipeline parallelism yet")
        if not hasattr(model, "lora_active"):
            raise ConfigError(f"LoRA adapters run on Llama-family models only, not {type(model).__name__}")
        self.max_lora_rank = max_lora_rank
        self.groups: RowGroups | None = None  # this step's adapter rows (grouped.py); None: none
        self.native_rows: torch.Tensor | None = None  # int32 [T] slot per row (-1 base); None: no adapter rows
        self.step_groups: cpu_lora.StepGroups | None = None  # the same rows grouped for lora.c (CPU fp32)
        self._table = None  # the slots' C table (kernels/cpu/lora.py), built on first use; the slots never move
        self.shapes: dict[tuple[int, str], tuple[int, int]] = {}
        layers = []
        for i, layer in enumerate(model.layers):
            for block, name, modules in FUSED:
                lin = getattr(getattr(layer, block), name)
                if len(lin.parts) != len(modules):
                    raise ConfigError(f"layer {i} {name} fuses {len(lin.parts)} parts, LoRA expects {len(modules)}")
                for module, n in zip(modules, lin.parts):
                    self.shapes[(i, module)] = (lin.in_features, n)
                device = (lin.qweight if lin.quantized else lin.weight).device
                layers.append(LinearSlots(i, list(zip(modules, lin.parts)), lin.in_features, max_loras,
                                          max_lora_rank, device, dtype or torch.float32))
        self.slots = LoRASlots(layers, max_loras, max_cpu_loras or max_loras)
        self.sharded = getattr(getattr(model, "tp", None), "size", 1) > 1
        if self.sharded:  # adapters are checked whole, then cut as the base weights are
            self.shapes = full_shapes(model)
        self.attach(model)

    def attach(self, model: nn.Module) -> None:
        """Hook ``model`` (at start, or a model reloaded after sleep level 2 with the same shapes);
        the slots, their adapters and their pointers stay as they are."""
        self.model = model
        ls_iter = iter(self.slots.layers)
        self._hooked: list[LinearSlots] = []  # in the slot table's order: a hook's index into it
        for layer in model.layers:
            for block, name, _ in FUSED:
                getattr(getattr(layer, block), name).register_forward_hook(self._hook(next(ls_iter)))
        model.lora = self

    def _hook(self, ls: LinearSlots):
        index, widths = len(self._hooked), [n for _, n in ls.parts]
        self._hooked.append(ls)

        def hook(module, inputs, out):
            if self.groups is None:
                return out
            x = inputs[0]
            g = self.step_groups
            if g is not None and x.dtype == out.dtype == torch.float32 and x.dim() == out.dim() == 2 \
                    and x.shape[0] == g.num_rows and x.stride(1) == 1 and out.stride(1) == 1:
                g.apply(index, x, out, widths)  # the native step's C loop (kernels/cpu/lora.c)
            else:
                add_lora(out, x, self.groups, ls.a, ls.b)
            return out
        return hook

    def cpu_kernel_reason(self) -> str | None:
        """None where the C products (kernels/cpu/lora.c) can serve these slots, else why not: they
        read fp32 stacks in host memory, every rank's whole adapters, and need the kernels built."""
        if self.sharded:
            return "LoRA under tensor parallelism"
        ls = self.slots.layers
        if not ls or ls[0].bt is None or ls[0].a.dtype != torch.float32:
            return "LoRA slots are not float32 on the cpu"
        if not cpu_lora.available():
            return "the C kernels are not built"
        return None

    def load(self, name: str, lora_id: int, path: str) -> LoRAAdapter:
        """Read, check and keep an adapter in host memory (ConfigError if it does not fit this model)."""
        adapter = load_peft_adapter(name, lora_id, path, self.shapes, self.max_lora_rank)
        if self.sharded:
            adapter = shard_adapter(adapter, self.model)
        self.slots.add(adapter)
        return adapter

    def ensure(self, lora_request) -> int:
        """A request's adapter id, its adapter loaded into host memory if it is not there (0: none)."""
        if lora_request is None:
            return 0
        if lora_request.id not in self.slots.host:
            self.load(lora_request.name, lora_request.id, lora_request.path)
        return lora_request.id

    def unload(self, lora_id: int) -> None:
        self.slots.remove(lora_id)

    def set_rows(self, row_lora_ids: list[int]) -> None:
        """This step's adapter id per token row (0 = base); puts the adapters in slots and groups the
        rows once for every layer (the hooks' groups, and the native step's slot per row)."""
        ids = set(row_lora_ids) - {0}
        if not ids:
            self.groups, self.native_rows, self.step_groups = None, None, None
            self.model.lora_active = False
            return
        slot_of = self.slots.activate(ids)
        device = self.slots.layers[0].a.device if self.slots.layers else None
        row_slots = torch.tensor([slot_of.get(i, -1) for i in row_lora_ids], dtype=torch.long, device=device)
        self.groups = row_groups(row_slots)
        self.native_rows = row_slots.to("cpu", torch.int32) if row_slots.device.type == "cpu" else None
        self.step_groups = None
        if self.native_rows is not None and len(row_lora_ids) <= C_LOOP_MAX_ROWS and self.cpu_kernel_reason() is None:
            if self._table is None:
                self._table = cpu_lora.proj_table(self.slots.layers)
            self.step_groups = cpu_lora.StepGroups(self._table, self.native_rows, self.slots.max_loras,
                                                   self.max_lora_rank)
        self.model.lora_active = True
