"""layers/moe.py and layers/moe_router.py (this name, as test basenames are unique: tests/models
has test_moe.py): the grouped MoE layer against a plain per-token loop over the chosen experts, the
router's three kinds against their definitions, and the expert-parallel / tensor-parallel splits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncengine.errors import ConfigError
from asyncengine.layers.moe import ExpertShard, SparseMoE
from asyncengine.layers.moe_router import RouterSpec, route
from asyncengine.layers.parallel import TPGroup

E, H, I = 8, 16, 12


def make_moe(spec: RouterSpec, tp: TPGroup = TPGroup(), ep: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    router = torch.randn(E, H, generator=g)
    moe = SparseMoE(H, I, spec, tp=tp, expert_parallel=ep)
    moe.gate.load(router)
    moe.load_stacked(w13, w2)
    assert moe.missing() == []
    return moe, w13, w2, router


def reference(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += w * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("kind,renorm", [("softmax_topk", False), ("softmax_topk", True),
                                         ("topk_softmax", False), ("sigmoid", True)])
def test_grouped_equals_per_token_loop(kind, renorm):
    spec = RouterSpec(E, 2, kind, renorm)
    moe, w13, w2, router = make_moe(spec)
    for rows, record in ((33, False), (1, False), (1, True)):  # one row: the lone-decode path
        moe.record_load = record
        x = torch.randn(rows, H)
        weights, ids = route(x @ router.t(), spec)
        torch.testing.assert_close(moe(x), reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_router_definitions():
    logits = torch.randn(5, E)
    w, ids = route(logits, RouterSpec(E, 3, "softmax_topk", False))
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(w, p.gather(1, ids))
    assert torch.equal(ids, p.topk(3).indices)
    w, _ = route(logits, RouterSpec(E, 3, "softmax_topk", True))
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    w, ids = route(logits, RouterSpec(E, 3, "topk_softmax"))
    torch.testing.assert_close(w, torch.softmax(logits.topk(3).values, -1))
    # sigmoid: the bias picks the experts, the unbiased score weighs them
    bias = torch.zeros(E)
    bias[5] = 100.0
    w, ids = route(logits, RouterSpec(E, 2, "sigmoid"), bias)
    assert (ids == 5).any(dim=1).all()
    torch.testing.assert_close(w, torch.sigmoid(logits).gather(1, ids))


def test_router_spec_errors():
    with pytest.raises(ConfigError):
        RouterSpec(4, 5)
    with pytest.raises(ConfigError):
        RouterSpec(4, 2, "softmax")


@pytest.mark.parametrize("ep", [False, True])
def test_rank_shards_sum_to_whole(ep):
    """Two ranks' partial outputs (experts split whole under EP, columns split under TP) add up to
    the one-rank layer: the all-reduce is the combine."""
    spec = RouterSpec(E, 2, "softmax_topk", True)
    whole, *_ = make_moe(spec)
    parts = [make_moe(spec, TPGroup(rank=r, size=2), ep)[0] for r in range(2)]
    if ep:
        assert [(p.shard.expert_start, p.shard.expert_stop, p.w13.shape[1]) for p in parts] == [(0, 4, 2 * I), (4, 8, 2 * I)]
    else:
        assert [(p.shard.num_local, p.w13.shape[1]) for p in parts] == [(E, I), (E, I)]
    x = torch.randn(21, H)
    torch.testing.assert_close(parts[0](x) + parts[1](x), whole(x), rtol=1e-5, atol=1e-5)


def test_shard_errors_and_load_counts():
    with pytest.raises(ConfigError, match="experts"):
        ExpertShard.of(6, 8, TPGroup(rank=0, size=4), True)
    with pytest.raises(ConfigError, match="intermediate"):
        ExpertShard.of(8, 6, TPGroup(rank=0, size=4), False)
    moe, *_ = make_moe(RouterSpec(E, 2))
    moe.record_load = True
    moe(torch.randn(10, H))
    moe(torch.randn(7, H))
    assert int(moe.expert_load.sum()) == 2 * 17
    fresh = SparseMoE(H, I, RouterSpec(E, 2))
    assert len(fresh.missing()) == 3 * E


def test_grouped_sigmoid_router_and_plain_experts():
    """Nemotron-H's router: only experts of the best ``topk_groups`` groups (a group scores its best
    two) are chosen, weights scaled; its experts have no gate: down(relu(up x)^2)."""
    spec = RouterSpec(E, 2, "sigmoid", True, num_groups=4, topk_groups=1, scale=2.5)
    logits = torch.randn(50, E)
    w, ids = route(logits, spec)
    groups = torch.sigmoid(logits).view(50, 4, 2).topk(2, -1).values.sum(-1).argmax(-1)
    assert torch.equal(ids.sort(-1).values, torch.stack([groups * 2, groups * 2 + 1], -1))
    torch.testing.assert_close(w.sum(-1), torch.full((50,), 2.5))
    moe = SparseMoE(H, I, spec, "relu2", gated=False)
    up, down = torch.randn(E, I, H), torch.randn(E, H, I)
    for e in range(E):
        moe.load_expert(e, "up", up[e], False)
        moe.load_expert(e, "down", down[e], False)
    assert moe.missing() == []
    moe.gate.load(torch.randn(E, H))
    x = torch.randn(9, H)
    w, ids = route(moe.gate(x), spec)
    want = torch.stack([sum(w[t, j] * down[e] @ torch.relu(up[e] @ x[t]).square() for j, e in enumerate(ids[t].tolist()))
                        for t in range(9)])
    torch.testing.assert_close(moe(x), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError):
        SparseMoE(H, I, spec, "silu", gated=False)
