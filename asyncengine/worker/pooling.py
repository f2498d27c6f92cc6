"""Pooling requests in the runner: a request whose SamplingParams carry a ``pooling`` spec runs its
prompt in the same batches as generation; the rows of its prompt positions a step computes anyway
are folded into one vector as they go (chunked prefill: a running fp32 sum for ``mean``, the first
row for ``cls``, the last prompt row for ``last``), and the step that computes its last prompt
position hands the finished embedding back with the request's one (dropped) sampled token.

Why per request and not ``layers/pooler.pool_batch`` over the step: a chunked prompt spans
steps, so a step's rows are partial; what a request keeps between steps is one hidden-size
vector, never its rows."""
from __future__ import annotations

import torch

from asyncengine.layers.pooler import finish_embedding
from asyncengine.worker.request_state import RunnerRequestState

Span = tuple[RunnerRequestState, int, int, int]  # (state, first flat row, first position, count)


def pooling_spans(decodes: list[RunnerRequestState], prefills: list[tuple[RunnerRequestState, int]]) -> list[Span]:
    """The prompt positions this step computes for pooling requests, as the runner lays rows out
    (decodes first, then the prefill chunks in order). Call before the computed counts advance."""
    spans = []
    for i, st in enumerate(decodes):  # a one-token chunk mid-prompt is laid out as a decode row
        if st.sampling_params.pooling is not None and st.num_computed_tokens < st.num_prompt_tokens:
            spans.append((st, i, st.num_computed_tokens, 1))
    row = len(decodes)
    for st, n in prefills:
        if st.sampling_params.pooling is not None:
            m = min(st.num_computed_tokens + n, st.num_prompt_tokens) - st.num_computed_tokens
            if m > 0:
                spans.append((st, row, st.num_computed_tokens, m))
        row += n
    return spans


def token_types(spans: list[Span], num_rows: int, device) -> torch.Tensor | None:
    """Each row's token type for an encoder (0, and 1 from a pair's ``token_type_split`` on); None
    when no request of the step is a pair."""
    pairs = [(row, start, m, st.sampling_params.pooling.token_type_split) for st, row, start, m in spans
             if st.sampling_params.pooling.token_type_split is not None]
    if not pairs:
        return None
    types = torch.zeros(num_rows, dtype=torch.int64)
    for row, start, m, split in pairs:
        first = row + max(0, split - start)
        if first < row + m:
            types[first:row + m] = 1
    return types.to(device)


def pool_spans(hidden: torch.Tensor, spans: list[Span], head=None) -> dict[str, list[float]]:
    """Fold this step's rows into each request's running state; the embeddings of the requests
    whose prompt ended this step, by request id. A chunk from position 0 (a first run, or a
    recompute after preemption) starts the state afresh. ``head``: the model's classification
    head (pooled vectors [n, H] -> logits), which a ``task="classify"`` request's vector goes
    through instead of the normalisation."""
    out: dict[str, list[float]] = {}
    for st, row, start, m in spans:
        spec = st.sampling_params.pooling
        end = start + m
        if start == 0:
            st.pool_state = None
        if spec.pooling == "mean":
            part = hidden[row:row + m].to(torch.float32).sum(dim=0)
            st.pool_state = part if st.pool_state is None else st.pool_state + part
        elif spec.pooling == "cls" and start == 0:
            st.pool_state = hidden[row].to(torch.float32)
        elif spec.pooling == "last" and end == st.num_prompt_tokens:
            st.pool_state = hidden[row + m - 1].to(torch.float32)
        if end == st.num_prompt_tokens:
            v = st.pool_state / st.num_prompt_tokens if spec.pooling == "mean" else st.pool_state
            if spec.task == "classify":
                out[st.req_id] = head(v[None].to(hidden.dtype))[0].float().tolist()
            else:
                out[st.req_id] = finish_embedding(v, spec.normalize, spec.dimensions).tolist()
            st.pool_state = None
    return out
