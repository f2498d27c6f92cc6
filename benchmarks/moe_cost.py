#!/usr/bin/env python
"""What a mixture-of-experts layer costs next to the dense MLP it replaces (layers/moe.py).

    python benchmarks/moe_cost.py --out benchmarks/results/moe_cost.json

Random fp32 weights, nothing downloaded; one layer, hidden --hidden, --experts experts of
intermediate --inter, top --top-k (defaults: 1024, 16, 512, 2: Qwen-MoE-like proportions).

  batch 1    the MoE layer (router + grouped experts) against a dense gated MLP with the same
             *active* parameters (intermediate top_k x inter): the router, the sort and the scatter
             are the overhead (target: within 1.3x).
  batch 64   the grouped path (one sort, one gather, one GEMM pair per active expert, one scatter)
             against a per-expert loop in plain torch (transformers' shape: for each expert, find
             its tokens with ``torch.where``, gather, GEMM, scatter).

Medians of --reps timed calls after warm-up, --threads torch threads (1 by default: the host is
shared and one thread's time is the work done).

``--qtype Q8_0`` (or Q4_0, Q4_1): the experts and the dense MLP in that GGUF block format with int8
activations, as a GGUF MoE file runs: the MoE layer is then one call into kernels/cpu/moe.c
(layers/moe_native.py); the dense MLP of the same active parameters runs two ways: two quantized
Linears from Python, and through the same C call as a one-expert layer (its router is then a
single dot product), which isolates what routing k experts costs over one GEMM pair.
``--layers N`` cycles through N copies of each so that the weights come from memory, not cache, as
in a real decode.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from single_stream import cpu_info  # the CPU model and SIMD flags, as every benchmark records them

import torch
import torch.nn.functional as F

from asyncengine.layers.activation import ActAndMul
from asyncengine.layers.linear import Linear
from asyncengine.layers.moe import SparseMoE
from asyncengine.layers.moe_router import RouterSpec, route


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def make_moe(h: int, i: int, e: int, k: int, qtype: str | None = None) -> SparseMoE:
    """E experts of intermediate i, top k (E = k = 1: a dense MLP behind the same code)."""
    moe = SparseMoE(h, i, RouterSpec(e, k, "softmax_topk", True), expert_linears=qtype is not None)
    moe.gate.load(torch.randn(e, h) / h ** 0.5)
    if qtype is not None:
        for m in moe.experts:
            m.gate_up_proj.quantize_as(qtype)
            m.down_proj.quantize_as(qtype)
    moe.load_stacked(torch.randn(e, 2 * i, h) / h ** 0.5, torch.randn(e, h, i) / i ** 0.5)
    return moe


def quantized_mlp(h: int, i: int, qtype: str):
    """A dense gated MLP of two block-quantized Linears (int8 activations)."""
    gu, down, act = Linear(h, 2 * i, parts=(i, i)), Linear(i, h), ActAndMul("silu")
    for lin, w in ((gu, torch.randn(2 * i, h) / h ** 0.5), (down, torch.randn(h, i) / i ** 0.5)):
        lin.quantize_as(qtype)
        lin.load(w)
        lin.set_activations("int8")
    return lambda x: down(act(gu(x)))


def quantized_batch1(a) -> dict:
    """Batch 1 with block-quantized experts: the native MoE layer against a quantized dense MLP."""
    h, i, e, k = a.hidden, a.inter, a.experts, a.top_k
    moes = [make_moe(h, i, e, k, a.qtype) for _ in range(a.layers)]
    for moe in moes:
        for m in moe.experts:
            m.gate_up_proj.set_activations("int8")
            m.down_proj.set_activations("int8")
    denses = [quantized_mlp(h, k * i, a.qtype) for _ in range(a.layers)]
    one_expert = [make_moe(h, k * i, 1, 1, a.qtype) for _ in range(a.layers)]
    for moe in one_expert:
        moe.experts[0].gate_up_proj.set_activations("int8")
        moe.experts[0].down_proj.set_activations("int8")
    x1 = torch.randn(1, h)

    def cycle(fns):
        return lambda: [f(x1) for f in fns]

    return {"batch1_moe_ms": timed(cycle(moes), a.reps) * 1e3 / a.layers,
            "batch1_dense_same_active_ms": timed(cycle(denses), a.reps) * 1e3 / a.layers,
            "batch1_dense_native_same_active_ms": timed(cycle(one_expert), a.reps) * 1e3 / a.layers}


def loop_moe(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The per-expert loop: every expert looks for its tokens."""
    weights, ids = route(moe.gate(x), moe.spec)
    out = torch.zeros_like(x)
    for e in range(moe.spec.num_experts):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        gate, up = F.linear(x[tok], moe.w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, moe.w2[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y)
    return out


def fp32_rows(a) -> dict:
    """fp32 stacked experts: batch 1 against a dense MLP, batch 64 against the per-expert loop."""
    h, i, e, k = a.hidden, a.inter, a.experts, a.top_k
    moe = make_moe(h, i, e, k)
    dense_gu = torch.randn(2 * k * i, h) / h ** 0.5
    dense_d = torch.randn(h, k * i) / (k * i) ** 0.5

    def dense(x):
        gate, up = F.linear(x, dense_gu).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, dense_d)

    x1, x64 = torch.randn(1, h), torch.randn(64, h)
    torch.testing.assert_close(moe(x64), loop_moe(moe, x64), rtol=1e-4, atol=1e-4)
    return {"batch1_moe_ms": timed(lambda: moe(x1), a.reps) * 1e3,
            "batch1_dense_same_active_ms": timed(lambda: dense(x1), a.reps) * 1e3,
            "batch64_grouped_ms": timed(lambda: moe(x64), a.reps) * 1e3,
            "batch64_loop_ms": timed(lambda: loop_moe(moe, x64), a.reps) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--qtype", help="experts and dense MLP in this GGUF block format (int8 activations)")
    ap.add_argument("--layers", type=int, default=1, help="copies of each cycled through (--qtype only)")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    with torch.inference_mode():
        rows = quantized_batch1(a) if a.qtype else fp32_rows(a)
    rows["batch1_ratio"] = rows["batch1_moe_ms"] / rows["batch1_dense_same_active_ms"]
    if a.qtype:
        rows["batch1_ratio_native"] = rows["batch1_moe_ms"] / rows["batch1_dense_native_same_active_ms"]
    else:
        rows["batch64_speedup"] = rows["batch64_loop_ms"] / rows["batch64_grouped_ms"]
    result = {"config": vars(a), "cpu": cpu_info(), "torch": torch.__version__,
              **{k2: round(v, 4) for k2, v in rows.items()}}
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
