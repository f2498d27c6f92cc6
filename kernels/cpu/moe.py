"""The MoE layer of kernels/cpu/moe.c from Python: the struct it reads (moe.h) and one call.

The per-op model's :class:`~asyncengine.layers.moe.SparseMoE` calls :func:`forward` for its small
steps; the native decode step (models/llama_native.py) puts the same table in its layer table, so
both paths run the same code on the same bytes."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from asyncengine.kernels.cpu.build import load

ptr, c_int, i32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int32

KINDS = {"softmax_topk": 0, "topk_softmax": 1}  # moe.h's AE_MOE_*: the router kinds written in C


class MoeLayer(ctypes.Structure):  # ae_moe_layer
    _fields_ = [("router", ptr), ("gate_up", ptr), ("down", ptr), ("gate_up_type", ptr), ("down_type", ptr),
                ("shared_gate_up", ptr), ("shared_down", ptr), ("shared_gate", ptr),
                ("shared_gate_up_type", i32), ("shared_down_type", i32), ("shared_inter", i32),
                ("num_experts", i32), ("top_k", i32), ("kind", i32), ("renormalize", i32),
                ("expert_start", i32), ("num_local", i32), ("inter", i32), ("act_int8", i32), ("scale", ctypes.c_float)]


_forward = None


def _fn():
    """ae_moe_forward, bound once (it returns an int: build.LazyBinding binds void functions)."""
    global _forward
    if _forward is None:
        fn = load().ae_moe_forward
        fn.argtypes, fn.restype = [ptr, ptr, c_int, c_int, ptr, ptr, c_int], c_int
        _forward = fn
    return _forward


def available() -> bool:
    return load() is not None


@dataclass(frozen=True)
class Projection:
    """One block-quantized weight as the C side takes it: its bytes' address and GGML type id."""

    address: int
    type_id: int


@dataclass
class Table:
    """An ``ae_moe_layer`` and the arrays it points into (kept alive with it)."""

    layer: MoeLayer
    arrays: tuple

    @property
    def address(self) -> int:
        return ctypes.addressof(self.layer)


def make_table(router: torch.Tensor, experts: list[tuple[Projection, Projection]], *, num_experts: int, top_k: int,
               kind: str, renormalize: bool, scale: float, expert_start: int, inter: int, act_int8: bool,
               shared: tuple[Projection, Projection, int] | None = None,
               shared_gate: torch.Tensor | None = None) -> Table:
    """``router`` [E, H] fp32 contiguous; ``experts``: this rank's (gate_up, down) in expert order;
    ``shared``: (gate_up, down, its intermediate size); ``shared_gate``: [H] fp32 contiguous."""
    n = len(experts)
    gu = (ptr * n)(*[g.address for g, _ in experts])
    dn = (ptr * n)(*[d.address for _, d in experts])
    gut = (i32 * n)(*[g.type_id for g, _ in experts])
    dnt = (i32 * n)(*[d.type_id for _, d in experts])
    s_gu, s_dn, s_inter = shared if shared is not None else (None, None, 0)
    layer = MoeLayer(router.data_ptr(), ctypes.addressof(gu), ctypes.addressof(dn), ctypes.addressof(gut),
                     ctypes.addressof(dnt), s_gu.address if s_gu else None, s_dn.address if s_dn else None,
                     shared_gate.data_ptr() if shared_gate is not None else None,
                     s_gu.type_id if s_gu else 0, s_dn.type_id if s_dn else 0, s_inter,
                     num_experts, top_k, KINDS[kind], int(renormalize), expert_start, n, inter, int(act_int8),
                     scale)
    return Table(layer, (gu, dn, gut, dnt, router, shared_gate))


def forward(table: Table, x: torch.Tensor, load: torch.Tensor | None) -> torch.Tensor:
    """The layer's output for ``x`` [T, H] fp32; ``load`` (int64 [E]) gets each expert's token count added."""
    x = x.contiguous()
    out = torch.empty_like(x)
    rc = _fn()(table.address, x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(),
                 None if load is None else load.data_ptr(), torch.get_num_threads())
    if rc:
        raise MemoryError("the native MoE layer ran out of memory") if rc == -2 else \
            RuntimeError(f"the native MoE layer failed ({rc}: a bad argument or a GEMM)")
    return out
