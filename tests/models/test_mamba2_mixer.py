"""The Mamba2 mixer (asyncengine/layers/mamba2.py) against the recurrence it computes, and its
state slot's invariants: however a sequence is cut into prefill chunks and decode steps, the
outputs and the final state are those of one pass; a fresh chunk ignores what its slot held."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.layers.mamba2 import Mamba2Mixer, Mamba2Shape, SSMStepMeta, chunked_scan

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = Mamba2Shape(hidden_size=32, num_heads=4, head_dim=8, n_groups=2, d_state=8, conv_kernel=4, chunk_size=8)


def sequential_scan(x, dt, A, B, C, initial):
    """The recurrence, one position at a time: the definition the chunked algorithm must equal."""
    h = initial.clone()
    ys = []
    for t in range(x.shape[0]):
        h = h * torch.exp(dt[t] * A)[:, None, None] + (dt[t][:, None] * x[t]).unsqueeze(-1) * B[t].unsqueeze(1)
        ys.append((h @ C[t].unsqueeze(-1)).squeeze(-1))
    return torch.stack(ys), h


@settings(max_examples=30, deadline=None)
@given(length=st.integers(1, 40), chunk=st.sampled_from([1, 3, 8, 16]), with_initial=st.booleans(),
       seed=st.integers(0, 2**16))
def test_chunked_scan_is_the_recurrence(length, chunk, with_initial, seed):
    g = torch.Generator().manual_seed(seed)
    H, G, P, N = 4, 2, 3, 5
    x = torch.randn(length, H, P, generator=g, dtype=torch.float64)
    B, C = (torch.randn(length, G, N, generator=g, dtype=torch.float64) for _ in range(2))
    dt = torch.rand(length, H, generator=g, dtype=torch.float64)
    A = -torch.rand(H, generator=g, dtype=torch.float64) * 2
    init = torch.randn(H, P, N, generator=g, dtype=torch.float64) if with_initial else torch.zeros(H, P, N, dtype=torch.float64)
    y, final = chunked_scan(x, dt, A, B, C, chunk, init if with_initial else None)
    heads_b, heads_c = (t.repeat_interleave(H // G, dim=1) for t in (B, C))  # head h reads group h // 2
    y_ref, final_ref = sequential_scan(x, dt, A, heads_b, heads_c, init)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(final, final_ref)


def make_mixer(seed: int = 0) -> Mamba2Mixer:
    torch.manual_seed(seed)
    m = Mamba2Mixer(SHAPE)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name == "A_log":
                p.copy_(torch.log(torch.linspace(0.05, 0.5, SHAPE.num_heads)))  # slow decay: long memory
            else:
                p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    return m


def new_state(slots: int = 2):
    return torch.zeros(SHAPE.conv_state_shape(slots)), torch.zeros(SHAPE.ssm_state_shape(slots))


def prefill(m, x, state, slot, fresh):
    meta = SSMStepMeta(num_decodes=0, decode_slots=torch.empty(0, dtype=torch.long),
                       prefills=[(0, x.shape[0], slot, fresh)], states=[state])
    return m(x, state, meta)


def decode(m, x, state, slots, run: bool = False):
    """``run``: the slots form one range, updated through views (the runner's fast case), the rows
    permuted into slot order when they are not in it."""
    order = None
    if run and slots != sorted(slots):
        order = torch.tensor(sorted(range(len(slots)), key=slots.__getitem__))
    meta = SSMStepMeta(num_decodes=x.shape[0], decode_slots=torch.tensor(slots), prefills=[], states=[state],
                       decode_run=(min(slots), max(slots) + 1) if run else None, decode_order=order)
    return m(x, state, meta)


@settings(max_examples=15, deadline=None)
@given(length=st.integers(2, 30), cuts=st.lists(st.integers(1, 29), max_size=4), decodes=st.integers(0, 4),
       seed=st.integers(0, 2**16))
def test_any_chunking_equals_one_pass(length, cuts, decodes, seed):
    """Prefill in chunks (the state carried in the slot), then decode steps: the same outputs and the
    same final state as one prefill of everything."""
    m = make_mixer()
    x = torch.randn(length + decodes, SHAPE.hidden_size, generator=torch.Generator().manual_seed(seed),
                    )
    whole_state = new_state()
    with torch.no_grad():
        whole = prefill(m, x, whole_state, 1, True)
        state = new_state()
        bounds = sorted({c for c in cuts if c < length} | {0, length})
        pieces = [prefill(m, x[a:b], state, 1, a == 0) for a, b in zip(bounds, bounds[1:])]
        for t in range(length, length + decodes):
            pieces.append(decode(m, x[t:t + 1], state, [1], run=t % 2 == 0))
    close = dict(rtol=1e-4, atol=1e-5)  # fp32 (the SSM state's dtype), summed in another order
    torch.testing.assert_close(torch.cat(pieces), whole, **close)
    torch.testing.assert_close(state[0][1], whole_state[0][1], **close)
    torch.testing.assert_close(state[1][1], whole_state[1][1], **close)


def test_fresh_chunk_ignores_the_slots_old_contents():
    m = make_mixer()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, SHAPE.hidden_size, generator=g)
    dirty, clean = new_state(), new_state()
    for t in dirty:
        t.normal_(generator=g)
    with torch.no_grad():
        torch.testing.assert_close(prefill(m, x, dirty, 1, True), prefill(m, x, clean, 1, True), rtol=0, atol=0)
    torch.testing.assert_close(dirty[1][1], clean[1][1], rtol=0, atol=0)
    torch.testing.assert_close(dirty[0][1], clean[0][1], rtol=0, atol=0)


def test_batched_decode_keeps_each_slot_to_itself():
    """Two requests decoding in one batch (slots listed out of order) get what each gets alone."""
    m = make_mixer()
    g = torch.Generator().manual_seed(2)
    a, b, step = torch.randn(7, SHAPE.hidden_size, generator=g), torch.randn(12, SHAPE.hidden_size, generator=g), \
        torch.randn(2, SHAPE.hidden_size, generator=g)
    together, alone_a, alone_b = new_state(), new_state(), new_state()
    with torch.no_grad():
        prefill(m, a, together, 0, True)
        prefill(m, b, together, 1, True)
        copy = tuple(t.clone() for t in together)
        copy2 = tuple(t.clone() for t in together)
        prefill(m, a, alone_a, 0, True)
        prefill(m, b, alone_b, 1, True)
        both = decode(m, step, together, [1, 0])
        both_again = decode(m, step[[1, 0]], copy, [0, 1], run=True)
        both_permuted = decode(m, step, copy2, [1, 0], run=True)
        out_b = decode(m, step[:1], alone_b, [1])
        out_a = decode(m, step[1:], alone_a, [0])
    torch.testing.assert_close(both, torch.cat([out_b, out_a]))
    torch.testing.assert_close(both_again, torch.cat([out_a, out_b]))
    torch.testing.assert_close(both_permuted, both)
    for x, y, z in zip(copy, copy2, together):
        torch.testing.assert_close(x, y)
        torch.testing.assert_close(y, z)
    torch.testing.assert_close(together[1][0], alone_a[1][0])
    torch.testing.assert_close(together[1][1], alone_b[1][1])
