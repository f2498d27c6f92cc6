"""layers/moe_native.py and kernels/cpu/moe.c: a MoE layer with block-quantized experts in one C
call against the torch grouped path of the same layer (every router kind written in C, with and
without renormalisation, a routed scaling factor, a gated or ungated shared expert, fp32 and int8
activations); every token's output independent of its batch, bit for bit; its load counts; where
it does not apply."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncengine.kernels.cpu import moe as cpu_moe
from asyncengine.layers import moe_native
from asyncengine.layers.activation import ActAndMul
from asyncengine.layers.linear import Linear
from asyncengine.layers.moe import SparseMoE, take_expert_load
from asyncengine.layers.moe_router import RouterSpec, route

E, H, I = 8, 64, 96

pytestmark = pytest.mark.skipif(not cpu_moe.available(), reason="the C kernels are not built")


class SharedMLP(nn.Module):
    def __init__(self, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(H, 2 * inter, parts=(inter, inter))
        self.down_proj = Linear(inter, H)
        self.act_and_mul = ActAndMul("silu")

    def forward(self, x):
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


def make_moe(spec: RouterSpec, qtype: str = "Q8_0", shared: str | None = None, activations: str = "fp32",
             seed: int = 0) -> SparseMoE:
    g = torch.Generator().manual_seed(seed)
    moe = SparseMoE(H, I, spec, shared=SharedMLP(32) if shared else None, shared_gate=shared == "gated",
                    expert_linears=True)
    lins = [lin for m in [*moe.experts, moe.shared_expert] if m is not None for lin in (m.gate_up_proj, m.down_proj)]
    for lin in lins:
        lin.quantize_as(qtype)
    moe.gate.load(torch.randn(E, H, generator=g))
    for e in range(E):
        for kind, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            moe.load_expert(e, kind, torch.randn(*shape, generator=g) / shape[1] ** 0.5, False)
    if shared:
        moe.shared_expert.gate_up_proj.load(torch.randn(64, H, generator=g) / H ** 0.5)
        moe.shared_expert.down_proj.load(torch.randn(H, 32, generator=g) / 32 ** 0.5)
        if shared == "gated":
            moe.shared_expert_gate.load(torch.randn(1, H, generator=g) / H ** 0.5)
    for lin in lins:
        lin.set_activations(activations)
    return moe


def torch_path(moe: SparseMoE, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(moe_native, "takes", lambda *_: None)
        return moe(x)


@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("kind,renorm,scale,shared", [
    ("softmax_topk", False, 1.0, None), ("softmax_topk", True, 1.0, "gated"), ("topk_softmax", False, 2.5, None),
    ("softmax_topk", True, 1.0, "always")])
def test_native_layer_equals_the_torch_grouped_path(kind, renorm, scale, shared, activations, monkeypatch):
    moe = make_moe(RouterSpec(E, 2, kind, renorm, scale=scale), shared=shared, activations=activations)
    assert moe_native.native_reason(moe) is None
    for rows in (1, 7):
        x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows))
        assert moe_native.takes(moe, x) is not None
        torch.testing.assert_close(moe(x), torch_path(moe, x, monkeypatch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_each_token_gets_the_same_bits_whatever_its_batch(qtype):
    moe = make_moe(RouterSpec(E, 3, "softmax_topk", True), qtype=qtype, activations="int8")
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3))
    whole = moe(x)
    for t in range(x.shape[0]):
        assert torch.equal(moe(x[t:t + 1]), whole[t:t + 1]), t


def test_load_counts_are_the_routers_choices():
    spec = RouterSpec(E, 2, "softmax_topk", True)
    moe = make_moe(spec)
    moe.record_load = True
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(4))
    moe(x)
    moe(x[:1])
    _, ids = route(x @ moe.gate.weight.t(), spec)
    want = torch.bincount(ids.reshape(-1), minlength=E) + torch.bincount(ids[0], minlength=E)
    assert take_expert_load([moe]) == want.tolist()
    assert take_expert_load([moe]) is None  # read and cleared


def test_where_it_does_not_apply(monkeypatch):
    spec = RouterSpec(E, 2, "softmax_topk")
    assert "stacked" in moe_native.native_reason(SparseMoE(H, I, spec))
    assert "router kind" in moe_native.native_reason(SparseMoE(H, I, RouterSpec(E, 2, "sigmoid"), expert_linears=True))
    dense = SparseMoE(H, I, spec, expert_linears=True)
    assert "dense" in moe_native.native_reason(dense)
    moe = make_moe(spec, activations="fp32")
    big = torch.randn(64, H)  # fp32 activations at 48+ rows: the tiled torch path is faster
    assert moe_native.takes(moe, big) is None and moe_native.takes(moe, big[:8]) is not None
    assert moe_native.takes(moe, big[:8].double()) is None
    moe.experts[3].down_proj.set_activations("int8")  # experts in two modes: no one table
    assert moe_native.table(moe) is None


def test_every_int8_isa_gives_the_same_bits():
    """The layer's GEMMs dispatch on the int8 kernel's ISA (forced in turn, as tests/kernels does)."""
    from asyncengine.kernels.cpu import quant

    moe = make_moe(RouterSpec(E, 2, "softmax_topk", True), qtype="Q4_1", shared="gated", activations="int8")
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(6))
    outs = {}
    try:
        for name in quant.ISAS[:quant.ISAS.index(quant.cpu_isa()) + 1]:
            quant.set_isa(name)
            outs[name] = moe(x)
    finally:
        quant.set_isa("auto")
    assert len(outs) >= 1 and all(torch.equal(o, outs["scalar"]) for o in outs.values())


def test_the_thread_count_does_not_change_the_bits():
    """Each output row comes from one single-threaded call over a fixed 64-row item (moe.c), so 1,
    2 or 3 threads give the same bits."""
    moe = make_moe(RouterSpec(E, 2, "softmax_topk", True), qtype="Q8_0", shared="gated", activations="int8")
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(8))
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(moe(x))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs)
