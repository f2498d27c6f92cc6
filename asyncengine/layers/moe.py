"""A mixture-of-experts feed-forward layer: a router picks k experts per token, each expert is a
gated MLP, the token's output is the routers' weighted sum of its experts' outputs.

Grouped, not looped: the (token, expert) pairs of a step are sorted by expert id, the tokens
gathered once (``index_select``) into one contiguous block per expert, and every *active* expert
runs one GEMM pair over its block; the results are weighted and scattered back with one
``index_add_``. The work is one matmul per active expert, never a Python loop over all experts
per token. Expert weights are stacked per layer: ``w13`` [E, 2I, H] ([gate | up] rows) and ``w2``
[E, H, I].

Parallel layouts (:class:`ExpertShard`), both combined by the one all-reduce the caller already
does for a row-parallel MLP:

- tensor parallel (default): every rank holds every expert's 1/N slice of the intermediate
  columns, so every rank runs every active expert on a thin slice;
- expert parallel (``EngineConfig.enable_expert_parallel``): rank r holds experts
  [r*E/N, (r+1)*E/N) whole; every rank routes every token (the router is replicated), runs only
  its own experts, and the all-reduce of the partial outputs is the combine. With data-parallel
  attention, ranks would hold different tokens: the dispatch then becomes an all-to-all of the
  gathered (token, expert) rows by owner rank (the sorted order computed here already groups rows
  by owner, since experts are numbered owner by owner) and the combine its inverse all-to-all;
  :meth:`SparseMoE.experts_forward` is the per-rank compute either way.

Per-expert storage (``expert_linears``, GGUF files): each expert is an :class:`ExpertMLP`, two
:class:`~asyncengine.layers.linear.Linear` (``gate_up_proj``, ``down_proj``), instead of a slice of
``w13`` / ``w2``: the loader then picks each expert's storage as for any Linear, so a GGUF's
experts stay in their block format (Q8_0, Q4_0, Q4_K...) and run through the quantized kernels.
On the CPU such a layer runs as one C call (layers/moe_native.py, kernels/cpu/moe.c): router,
grouping and every active expert's GEMMs without Python between them, the same call the native
decode step makes.

Load balance: with ``record_load`` set, each forward adds its tokens-per-expert counts to
``expert_load`` (a [E] int64 tensor; the C layer to ``native_load``), read and cleared by the
runner for ``stats()`` (:func:`take_expert_load`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asyncengine.errors import ConfigError
from asyncengine.kernels.cpu import moe as cpu_moe
from asyncengine.layers import moe_native
from asyncengine.layers.activation import ActAndMul
from asyncengine.layers.linear import Linear, QuantizedTensor
from asyncengine.layers.moe_router import RouterSpec, route
from asyncengine.layers.parallel import SINGLE, TPGroup


# activations of experts without a gate
PLAIN_ACTIVATIONS = {"relu2": lambda h: torch.relu(h).square()}


@dataclass(frozen=True)
class ExpertShard:
    """Which experts, and which intermediate columns of each, this rank holds."""

    expert_start: int
    expert_stop: int
    inter_start: int
    inter_stop: int

    @classmethod
    def of(cls, num_experts: int, inter: int, tp: TPGroup, expert_parallel: bool) -> "ExpertShard":
        n, r = tp.size, tp.rank
        if expert_parallel:
            if num_experts % n:
                raise ConfigError(f"expert parallel: {num_experts} experts do not split evenly over {n} ranks")
            per = num_experts // n
            return cls(r * per, (r + 1) * per, 0, inter)
        if inter % n:
            raise ConfigError(f"tensor parallel: the experts' intermediate size {inter} does not split over {n} ranks")
        per = inter // n
        return cls(0, num_experts, r * per, (r + 1) * per)

    @property
    def num_local(self) -> int:
        return self.expert_stop - self.expert_start

    @property
    def inter(self) -> int:
        return self.inter_stop - self.inter_start


class ExpertMLP(nn.Module):
    """One gated expert as two Linears: ``gate_up_proj`` ([gate | up] rows) and ``down_proj``."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, parts=(inter, inter))
        self.down_proj = Linear(inter, hidden)


def _narrow(tensor, dim: int, start: int, stop: int):
    """A tensor's (or blocks') slice [start, stop) along ``dim``; the tensor itself when whole."""
    if stop - start == tensor.shape[dim]:
        return tensor
    if isinstance(tensor, QuantizedTensor):
        return tensor.rows(start, stop) if dim == 0 else tensor.cols(start, stop)
    return tensor.narrow(dim, start, stop - start)


class SparseMoE(nn.Module):
    """Router (``gate``, a Linear [E, H]) + stacked experts; ``forward`` returns this rank's partial
    output (the caller all-reduces it). ``shared``: an optional always-on MLP module added to the
    output, scaled per token by ``sigmoid(shared_gate(x))`` when ``shared_gate`` is given (Qwen2-MoE)."""

    def __init__(self, hidden: int, inter: int, spec: RouterSpec, act: str = "silu", tp: TPGroup = SINGLE,
                 expert_parallel: bool = False, router_bias: bool = False, shared: nn.Module | None = None,
                 shared_gate: bool = False, gated: bool = True, expert_linears: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.hidden, self.full_inter = hidden, inter
        self.shard = ExpertShard.of(spec.num_experts, inter, tp, expert_parallel)
        e, i = self.shard.num_local, self.shard.inter
        self.gate = Linear(hidden, spec.num_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts), requires_grad=False) \
            if router_bias else None
        # gated experts: w13 holds [gate | up]; plain ones (Nemotron-H: down(act(up x))) only up
        self.gated = gated
        if expert_linears and not gated:
            raise ConfigError("per-expert Linear storage needs gated experts")
        self.experts = nn.ModuleList(ExpertMLP(hidden, i) for _ in range(e)) if expert_linears else None
        self.w13 = None if expert_linears else nn.Parameter(torch.empty(e, (2 if gated else 1) * i, hidden),
                                                            requires_grad=False)
        self.w2 = None if expert_linears else nn.Parameter(torch.empty(e, hidden, i), requires_grad=False)
        if not gated and act not in PLAIN_ACTIVATIONS:
            raise ConfigError(f"expert activation {act!r} without a gate is not supported ({', '.join(PLAIN_ACTIVATIONS)})")
        self.act_and_mul = ActAndMul(act) if gated else PLAIN_ACTIVATIONS[act]
        self.shared_expert = shared
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared_gate else None
        self._filled: set[tuple[int, str]] = set()
        self.record_load = False
        self.expert_load = None
        self.native_cache = None  # moe_native.table's (key, table)
        self.native_load = None  # int64 [E]: the C layer's token counts (moe_native.load_counter)

    # ------------------------------------------------------------------ weights

    def owns(self, expert: int) -> bool:
        return self.shard.expert_start <= expert < self.shard.expert_stop

    def expert_slice(self, kind: str) -> tuple[int, int, int]:
        """The ``(dim, start, stop)`` of one expert's checkpoint tensor this rank reads: ``kind`` is
        "gate"/"up" ([I, H], rows) or "down" ([H, I], columns)."""
        return (1 if kind == "down" else 0), self.shard.inter_start, self.shard.inter_stop

    def load_expert(self, expert: int, kind: str, tensor: torch.Tensor, sliced: bool) -> None:
        """One expert's "gate", "up" or "down" weight (HF layout), whole or already this rank's
        slice (``sliced``); an expert another rank owns is ignored."""
        if not self.owns(expert):
            return
        if not sliced:
            tensor = _narrow(tensor, *self.expert_slice(kind))
        i, local = self.shard.inter, expert - self.shard.expert_start
        if self.experts is not None:  # Linear.load checks the shape, converts blocks <-> dense
            m = self.experts[local]
            m.down_proj.load(tensor) if kind == "down" else m.gate_up_proj.load(tensor, 0 if kind == "gate" else 1)
            self._filled.add((expert, kind))
            return
        dst = {"gate": self.w13[local, :i], "up": self.w13[local, i:] if self.gated else self.w13[local],
               "down": self.w2[local]}[kind]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"expert {expert} {kind}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)
        self._filled.add((expert, kind))

    # an expert tensor as a part of ``w13`` / ``w2`` (the in-place weight update's key for it)
    _PARTS = ("gate", "up", "down")

    def part_of(self, expert: int, kind: str) -> int:
        return 3 * expert + self._PARTS.index(kind)

    def part_shape(self, part: int) -> tuple[int, int]:
        """The shape this rank holds of the expert tensor :meth:`part_of` numbered ``part``."""
        return (self.hidden, self.shard.inter) if part % 3 == 2 else (self.shard.inter, self.hidden)

    def load_part(self, part: int, tensor: torch.Tensor) -> None:
        """:meth:`load_expert` of an already-sliced tensor named by its :meth:`part_of` number."""
        self.load_expert(part // 3, self._PARTS[part % 3], tensor, True)

    def parts_complete(self, parts: set[int]) -> bool:
        kinds = (0, 1, 2) if self.gated else (1, 2)
        return all(3 * e + k in parts for e in range(self.shard.expert_start, self.shard.expert_stop) for k in kinds)

    def load_stacked(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """All experts at once, stacked as [E, 2I, H] ([gate | up]) and [E, H, I] (Granite)."""
        i = self.full_inter
        for e in range(self.shard.expert_start, self.shard.expert_stop):
            self.load_expert(e, "gate", w13[e, :i], False)
            self.load_expert(e, "up", w13[e, i:], False)
            self.load_expert(e, "down", w2[e], False)

    def loaded_keys(self, prefix: str) -> set[str]:
        """What weight_loading.check_complete counts for this layer's experts once all are filled."""
        if self.experts is None:
            return {f"{prefix}.w13#None", f"{prefix}.w2#None"}
        return {f"{prefix}.experts.{j}.{k}" for j in range(self.shard.num_local)
                for k in ("gate_up_proj.weight#0", "gate_up_proj.weight#1", "down_proj.weight#None")}

    def missing(self) -> list[str]:
        kinds = ("gate", "up", "down") if self.gated else ("up", "down")
        want = {(e, k) for e in range(self.shard.expert_start, self.shard.expert_stop) for k in kinds}
        return [f"expert {e} {k}" for e, k in sorted(want - self._filled)]

    # ------------------------------------------------------------------ compute

    def experts_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over this rank's experts of weight x expert(x), for the (token, expert) pairs in
        ``ids`` [T, k]; pairs naming another rank's expert contribute nothing here."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        if t == 1 and not self.record_load:  # a lone decode: no count, sort, gather or scatter
            return self._one_token(x, weights[0], flat)
        counts = torch.bincount(flat, minlength=self.spec.num_experts)
        if self.record_load:
            self.expert_load = counts if self.expert_load is None else self.expert_load + counts
        if t == 1:
            return self._one_token(x, weights[0], flat)
        order = torch.argsort(flat, stable=True)
        token = order // k
        w = weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
        xs = x.index_select(0, token)
        out = torch.zeros_like(x)
        ends = counts.cumsum(0).tolist()
        starts = [0] + ends[:-1]
        counts = counts.tolist()
        for e in range(self.shard.expert_start, self.shard.expert_stop):
            n = counts[e]
            if n == 0:
                continue
            s = starts[e]
            y = self._expert(e - self.shard.expert_start, xs[s:s + n]) * w[s:s + n]
            out.index_add_(0, token[s:s + n], y)
        return out

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The token's k experts, summed in expert-id order (the grouped path's order)."""
        out = None
        w = weights.to(x.dtype)
        for j, e in sorted(enumerate(ids.tolist()), key=lambda p: p[1]):
            if self.owns(e):
                y = self._expert(e - self.shard.expert_start, x) * w[j]
                out = y if out is None else out + y
        return torch.zeros_like(x) if out is None else out

    def _expert(self, local: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``local`` on the rows ``x``."""
        if self.experts is not None:
            m = self.experts[local]
            return m.down_proj(self.act_and_mul(m.gate_up_proj(x)))
        return torch.mm(self.act_and_mul(torch.mm(x, self.w13[local].t())), self.w2[local].t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = moe_native.takes(self, x)
        if native is not None:  # kernels/cpu/moe.c: the whole layer in one call
            return cpu_moe.forward(native, x, moe_native.load_counter(self))
        weights, ids = route(self.gate(x), self.spec, self.e_score_correction_bias)
        out = self.experts_forward(x, weights, ids)
        if self.shared_expert is not None:
            s = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            out = out + s
        return out


def take_expert_load(layers: list[SparseMoE]) -> list[int] | None:
    """Tokens routed to each expert since the last call, summed over ``layers`` (each must have
    ``record_load`` set); clears their counts. None when none of them ran."""
    total = None
    for m in layers:
        if m.expert_load is not None:
            total = m.expert_load if total is None else total + m.expert_load
            m.expert_load = None
        if m.native_load is not None and bool(m.native_load.any()):  # counted by kernels/cpu/moe.c
            total = m.native_load.clone() if total is None else total + m.native_load
            m.native_load.zero_()
    return None if total is None else total.tolist()
