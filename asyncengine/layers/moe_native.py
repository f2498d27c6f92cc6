"""The MoE layer's native path: when :class:`~asyncengine.layers.moe.SparseMoE` can hand a step to
kernels/cpu/moe.c, and the C table of its weights.

It applies to block-quantized experts on the CPU (a GGUF MoE file's, ``expert_linears``) with fp32
activations and a router kind written in C; the torch grouped path keeps everything else. The
native decode step (models/llama_native.py) takes the same table, so a step gives the same bits
whichever of the two runs it. Steps of :data:`quant.LARGE_M` rows or more in fp32-activation mode
stay on the torch path, whose tiled dequantize + ``torch.mm`` is faster there (as for any
quantized Linear); in int8 mode the kernels are the Linears' own at every size.
"""
from __future__ import annotations

import torch

from asyncengine.kernels.cpu import moe as cpu_moe, quant
from asyncengine.layers.linear import Linear


def _projection(lin: Linear) -> cpu_moe.Projection:
    return cpu_moe.Projection(lin.qweight.data_ptr(), quant.type_id(lin.qtype, lin.packed))


def _mlps(moe) -> list:
    """The gated MLPs the C layer runs: the experts, then the shared expert."""
    return list(moe.experts or ()) + ([moe.shared_expert] if moe.shared_expert is not None else [])


def native_reason(moe) -> str | None:
    """None where kernels/cpu/moe.c can run ``moe`` (a SparseMoE), else why not."""
    if moe.experts is None:
        return "the experts are stacked dense tensors (the torch grouped path runs them)"
    if moe.spec.kind not in cpu_moe.KINDS:
        return f"router kind {moe.spec.kind!r} is not in the native MoE layer"
    if moe.e_score_correction_bias is not None or not moe.gated or moe.act_and_mul.name != "silu":
        return "a router bias or experts other than SiLU-gated"
    g = moe.gate
    if g.quantized or g.weight.dtype != torch.float32 or g.weight.device.type != "cpu":
        return "the router is not a dense fp32 CPU weight"
    sg = moe.shared_expert_gate
    if sg is not None and (sg.quantized or sg.weight.dtype != torch.float32):
        return "the shared expert's gate is not a dense fp32 weight"
    s = moe.shared_expert
    if s is not None and (not all(hasattr(s, n) for n in ("gate_up_proj", "down_proj", "act_and_mul"))
                          or s.act_and_mul.name != "silu"):
        return "a shared expert that is not a SiLU-gated MLP"
    for m in _mlps(moe):
        if not (m.gate_up_proj.quantized and m.down_proj.quantized):
            return "an expert's weights are dense (the native MoE layer runs block-quantized ones)"
    if not cpu_moe.available():
        return "the C kernels are not built"
    return None


def _activation_mode(moe) -> str | None:
    """"int8" or "fp32" when every expert projection uses the same, else None."""
    modes = {lin.activations or quant.ACTIVATIONS for m in _mlps(moe) for lin in (m.gate_up_proj, m.down_proj)}
    return modes.pop() if len(modes) == 1 else None


def table(moe) -> cpu_moe.Table | None:
    """The C table of ``moe``'s weights, cached on it until the layers' storage modes change
    (:attr:`Linear.mode_epoch`, the default activation mode) or :func:`forget` (sleep); None where
    the native layer does not apply."""
    key = (Linear.mode_epoch, quant.ACTIVATIONS)
    cached = moe.native_cache
    if cached is not None and cached[0] == key:
        return cached[1]
    result = None
    mode = _activation_mode(moe) if native_reason(moe) is None else None
    if mode is not None:
        shared = moe.shared_expert
        result = cpu_moe.make_table(
            moe.gate.weight.contiguous(),
            [(_projection(m.gate_up_proj), _projection(m.down_proj)) for m in moe.experts],
            num_experts=moe.spec.num_experts, top_k=moe.spec.top_k, kind=moe.spec.kind,
            renormalize=moe.spec.renormalize, scale=moe.spec.scale, expert_start=moe.shard.expert_start,
            inter=moe.shard.inter, act_int8=mode == "int8",
            shared=None if shared is None else (_projection(shared.gate_up_proj), _projection(shared.down_proj),
                                                 shared.down_proj.in_features),
            shared_gate=None if moe.shared_expert_gate is None
            else moe.shared_expert_gate.weight.reshape(-1).contiguous())
    moe.native_cache = (key, result)
    return result


def forget(moe) -> None:
    moe.native_cache = None


def takes(moe, x: torch.Tensor) -> cpu_moe.Table | None:
    """The table when this step of ``x`` [T, H] runs natively, else None."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    t = table(moe)
    if t is None or (not t.layer.act_int8 and x.shape[0] >= quant.LARGE_M):
        return None
    return t


def load_counter(moe) -> torch.Tensor | None:
    """The int64 [E] counts the C layer adds each step's routed tokens to (when the runner records
    load; :func:`~asyncengine.layers.moe.take_expert_load` reads and clears them)."""
    if not moe.record_load:
        return None
    if moe.native_load is None:
        moe.native_load = torch.zeros(moe.spec.num_experts, dtype=torch.int64)
    return moe.native_load
