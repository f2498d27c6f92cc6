"""The Mamba2 mixer (state-space duality, Dao & Gu 2024) over a flat, unpadded token batch.

Per token: ``in_proj`` gives a gate ``z``, the conv input ``xBC`` and a time step ``dt`` per head;
a causal depthwise conv1d (kernel K) mixes ``xBC`` over the last K positions; the selective scan
runs the recurrence, per head h with scalar decay ``A_h < 0``::

    state_t = exp(dt_t A_h) state_{t-1} + dt_t x_t B_t^T        state: [head_dim, d_state]
    y_t     = state_t C_t + D_h x_t

then a gated RMSNorm (``norm(y * silu(z))``, per group of heads) and ``out_proj``.

A request carries two tensors between steps, its *state slot*: the conv window (the last K-1
``xBC`` columns) and the SSM state (fp32: it integrates over the whole sequence). The runner lays a
step out as decodes first, then prefill chunks (``SSMStepMeta``):

* decodes, batched: one conv window shift and one recurrence step per request;
* prefill chunks, one sequence at a time: the conv over [saved window | chunk], then the chunked
  scan (the SSD algorithm: within a chunk of ``chunk_size`` positions the output is an attention-
  like product masked by cumulative decays; between chunks only the [head_dim, d_state] state
  flows), starting from the slot's state, so chunked prefill carries the state across chunks.

This is the torch reference the engine runs on every device (transformers' CPU path computes the
same, with the same chunking; tests/models/test_hybrid_parity.py holds us to its greedy tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.layers.linear import Linear


@dataclass(frozen=True)
class Mamba2Shape:
    """What a Mamba2 mixer's weights and state slot look like (from an HF config's fields)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int
    chunk_size: int
    use_bias: bool = False
    use_conv_bias: bool = True
    norm_eps: float = 1e-5
    dt_min: float = 0.0  # time_step_limit: dt is clamped to [dt_min, dt_max] after the softplus
    dt_max: float = float("inf")

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x, then B and C of every group."""
        return self.inner_size + 2 * self.n_groups * self.d_state

    def conv_state_shape(self, num_slots: int) -> tuple[int, ...]:
        return (num_slots, self.conv_dim, self.conv_kernel - 1)

    def ssm_state_shape(self, num_slots: int) -> tuple[int, ...]:
        return (num_slots, self.num_heads, self.head_dim, self.d_state)

    def state_bytes(self, conv_dtype_bytes: int) -> int:
        """One request's slot in one layer: the conv window in the model's dtype, the SSM state fp32."""
        return (self.conv_dim * (self.conv_kernel - 1) * conv_dtype_bytes
                + self.num_heads * self.head_dim * self.d_state * 4)


@dataclass
class SSMStepMeta:
    """Where each request's rows and state slot are in this step (built by the runner once, read by
    every Mamba layer). Rows ``[0, num_decodes)`` are single-token decodes whose slots are
    ``decode_slots``; then one ``(first row, num rows, slot, fresh)`` per prefill chunk, where
    ``fresh`` means the chunk starts the sequence (its slot's old contents are ignored)."""

    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] int64
    prefills: list[tuple[int, int, int, bool]]
    states: list[tuple[torch.Tensor, torch.Tensor]]  # per Mamba layer: (conv windows, SSM states)
    # the decode slots are exactly the slots a..b-1: update views in place; ``decode_order``: the
    # rows in slot order when they are not already (None: they are)
    decode_run: tuple[int, int] | None = None
    decode_order: torch.Tensor | None = None


class GatedRMSNorm(nn.Module):
    """``RMSNorm(y * silu(z))`` over groups of ``group_size`` channels, in fp32 (as the reference)."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, s: Mamba2Shape) -> None:
        super().__init__()
        self.s = s
        d_in = s.inner_size
        # one projection: [z | xBC | dt]
        self.in_proj = Linear(s.hidden_size, d_in + s.conv_dim + s.num_heads, bias=s.use_bias)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=s.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(s.num_heads))
        self.A_log = nn.Parameter(torch.empty(s.num_heads))
        self.D = nn.Parameter(torch.empty(s.num_heads))
        self.norm = GatedRMSNorm(d_in, d_in // s.n_groups, s.norm_eps)
        self.out_proj = Linear(d_in, s.hidden_size, bias=s.use_bias)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta: SSMStepMeta) -> torch.Tensor:
        """x: [T, hidden]; state: this layer's (conv [slots, conv_dim, K-1], ssm [slots, H, P, N]),
        updated in place for every request in the step."""
        s = self.s
        conv_state, ssm_state = state
        z, xbc, dt = self.in_proj(x).split([s.inner_size, s.conv_dim, s.num_heads], dim=-1)
        A = -torch.exp(self.A_log.float())
        nd = meta.num_decodes
        y = torch.empty(x.shape[0], s.inner_size, dtype=x.dtype, device=x.device)
        if nd:
            y[:nd] = self._decode(xbc[:nd], dt[:nd], A, conv_state, ssm_state, meta)
        for start, n, slot, fresh in meta.prefills:
            y[start:start + n] = self._prefill(xbc[start:start + n], dt[start:start + n], A,
                                               conv_state, ssm_state, slot, fresh)
        return self.out_proj(self.norm(y, z))

    # ------------------------------------------------------------------ pieces

    def _decode(self, xbc, dt, A, conv_state, ssm_state, meta: SSMStepMeta):
        """One token per request: shift each conv window, one recurrence step. Slots that form one
        range (a single request, or requests admitted together) are updated in place through
        views, the rows taken in slot order; others are gathered and written back. Heads stay grouped ([G, heads per
        group]) so B and C broadcast instead of being repeated per head."""
        s = self.s
        n = xbc.shape[0]
        G, rep, P, N = s.n_groups, s.num_heads // s.n_groups, s.head_dim, s.d_state
        run, order = meta.decode_run, meta.decode_order
        if order is not None:  # rows into slot order (the inputs are small, the states large)
            xbc, dt = xbc[order], dt[order]
        conv_prev = conv_state[run[0]:run[1]] if run else conv_state[meta.decode_slots]
        window = torch.cat([conv_prev, xbc.unsqueeze(-1)], dim=-1)  # [n, conv_dim, K]
        if run:
            conv_prev.copy_(window[:, :, 1:])
        else:
            conv_state[meta.decode_slots] = window[:, :, 1:]
        conv = (window * self.conv1d.weight.squeeze(1)).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        xs, B, C = F.silu(conv).split([s.inner_size, G * N, G * N], dim=-1)
        xs = xs.float()
        dt = F.softplus((dt + self.dt_bias).float()).clamp(s.dt_min, s.dt_max)  # [n, H]
        h = ssm_state[run[0]:run[1]] if run else ssm_state[meta.decode_slots]
        hv = h.view(n, G, rep, P, N)
        hv.mul_(torch.exp(dt * A).view(n, G, rep, 1, 1))
        hv.add_((dt.unsqueeze(-1) * xs.view(n, -1, P)).view(n, G, rep, P, 1) * B.float().view(n, G, 1, 1, N))
        if not run:
            ssm_state[meta.decode_slots] = h
        y = (hv * C.float().view(n, G, 1, 1, N)).sum(-1).view(n, s.num_heads, P)
        y = (y + self.D.float()[:, None] * xs.view(n, s.num_heads, P)).view(n, -1).to(xbc.dtype)
        if order is None:
            return y
        out = torch.empty_like(y)
        out[order] = y
        return out

    def _prefill(self, xbc, dt, A, conv_state, ssm_state, slot: int, fresh: bool):
        """A chunk of one sequence, continuing from its slot's state (zeros when ``fresh``)."""
        s = self.s
        if fresh:
            conv_state[slot].zero_()
            ssm_state[slot].zero_()
        seq = torch.cat([conv_state[slot], xbc.t()], dim=-1)  # [conv_dim, K-1 + n]
        conv_state[slot] = seq[:, -(s.conv_kernel - 1):]
        conv = F.conv1d(seq.unsqueeze(0), self.conv1d.weight, self.conv1d.bias, groups=s.conv_dim)[0].t()
        n = xbc.shape[0]
        xs, B, C = F.silu(conv).split([s.inner_size, s.n_groups * s.d_state, s.n_groups * s.d_state], dim=-1)
        xs = xs.reshape(n, s.num_heads, s.head_dim)
        dt = F.softplus((dt + self.dt_bias).float()).clamp(s.dt_min, s.dt_max)  # [n, H]
        y, final = chunked_scan(xs.float(), dt, A, B.float().reshape(n, s.n_groups, s.d_state),
                                C.float().reshape(n, s.n_groups, s.d_state), s.chunk_size,
                                None if fresh else ssm_state[slot])
        ssm_state[slot] = final
        y = y + self.D.float()[:, None] * xs.float()
        return y.reshape(xs.shape[0], -1).to(xbc.dtype)


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: entry (l, s) = a[s+1] + ... + a[l] for s <= l, -inf above the
    diagonal (exp of it is the decay from s to l). Summed term by term, not as a difference of two
    cumulative sums (which loses the small differences of large sums); the running sums go along
    the contiguous last dimension, then the result is transposed (a view)."""
    L = a.shape[-1]
    rows = a.unsqueeze(-2).expand(*a.shape[:-1], L, L)  # rows[s, l] = a[l]
    after = torch.triu(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=1)  # l > s
    sums = torch.cumsum(rows.masked_fill(~after, 0), dim=-1)  # [s, l] = a[s+1] + ... + a[l]
    return sums.masked_fill(~torch.triu(torch.ones(L, L, dtype=torch.bool, device=a.device)), -torch.inf).transpose(-1, -2)


def chunked_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 chunk_size: int, initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan of one sequence, fp32. x [L, H, P], dt [L, H], A [H], B and C [L, G, N] (head h
    reads group h // (H / G)), initial [H, P, N] or None (zeros). Returns (y [L, H, P] without the D
    skip, the final state [H, P, N]).

    Positions are cut into chunks of ``chunk_size`` from the first one (the last chunk padded with
    zeros, which leave outputs and state exactly as they are; a sequence shorter than a chunk is one
    chunk of its own length). Work is laid out head-major so every product is a batched matmul, and
    C B^T is computed once per group, not per head."""
    L, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    rep = H // G
    Q = min(chunk_size, L)
    pad = (-L) % Q
    xdt = x * dt.unsqueeze(-1)
    a = dt * A  # [L, H] log-decay per step
    if pad:
        xdt, a, B, C = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (xdt, a, B, C))
    nc = (L + pad) // Q
    xdt = xdt.view(nc, Q, G, rep, P).permute(0, 2, 3, 1, 4)  # [c, G, rep, Q, P]
    B = B.view(nc, Q, G, N).transpose(1, 2).unsqueeze(2)  # [c, G, 1, Q, N]
    C = C.view(nc, Q, G, N).transpose(1, 2).unsqueeze(2)
    a = a.view(nc, Q, G, rep).permute(0, 2, 3, 1)  # [c, G, rep, Q]
    cum = torch.cumsum(a, dim=-1)

    # 1. within each chunk: y_l = sum_{s<=l} (C_l . B_s) exp(a_{s+1} + ... + a_l) x_s dt_s
    scores = C @ B.transpose(-1, -2)  # [c, G, 1, l, s]
    y = (scores * torch.exp(_segment_sum(a))) @ xdt  # [c, G, rep, Q, P]

    # 2. each chunk's own contribution to the state at its end: sum_l decay(l -> end) x_l dt_l B_l^T
    to_end = torch.exp(cum[..., -1:] - cum)  # [c, G, rep, Q]
    local = (xdt * to_end.unsqueeze(-1)).transpose(-1, -2) @ B  # [c, G, rep, P, N]

    # 3. the state entering each chunk: the previous one decayed over the chunk, plus its own part
    state = (torch.zeros(G, rep, P, N, dtype=x.dtype, device=x.device) if initial is None
             else initial.reshape(G, rep, P, N))
    chunk_decay = torch.exp(cum[..., -1])  # [c, G, rep]
    entering = []
    for c in range(nc):
        entering.append(state)
        state = state * chunk_decay[c][..., None, None] + local[c]
    entering = torch.stack(entering)  # [c, G, rep, P, N]

    # 4. what each position reads of the state that entered its chunk, decayed to the position
    y = y + (C @ entering.transpose(-1, -2)) * torch.exp(cum).unsqueeze(-1)
    y = y.permute(0, 3, 1, 2, 4).reshape(nc * Q, H, P)
    return y[:L], state.reshape(H, P, N)
