"""Prompt logprobs: for the requests that asked for them, the logprob (and the top k) of each next
prompt token, read from the hidden states of the prompt positions a step computes anyway. Which
flat rows those are follows the runner's batch layout; the logits are computed a slice of rows at
a time, so a long prefill chunk never holds [chunk, vocab] logits at once."""
from __future__ import annotations

from typing import Callable

import torch

from asyncengine.worker.request_state import RunnerRequestState
from asyncengine.worker.sampler import gather_logprobs

Span = tuple[RunnerRequestState, int, int, int]  # (state, first flat row, first position, count)


def prompt_logprob_spans(decodes: list[RunnerRequestState], prefills: list[tuple[RunnerRequestState, int]],
                         positions: list[int]) -> list[Span]:
    """(state, first flat row, first position, count) of the prompt positions this step computes
    for requests with prompt_logprobs: every position but the prompt's last (whose logits are
    the first sample's). Call before the computed counts advance; rows as the runner lays them
    out (decodes first, then the prefill chunks in order)."""
    spans = []
    for i, st in enumerate(decodes):
        if st.sampling_params.prompt_logprobs is not None and st.num_computed_tokens < st.num_prompt_tokens - 1:
            spans.append((st, i, st.num_computed_tokens, 1))
    row = len(decodes)
    for st, n in prefills:
        if st.sampling_params.prompt_logprobs is not None:
            start = st.num_computed_tokens
            m = min(start + n, st.num_prompt_tokens - 1) - start
            if m > 0:
                spans.append((st, row, start, m))
        row += n
    for st, row, start, m in spans:  # the batch layout is as assumed above
        assert positions[row] == start and positions[row + m - 1] == start + m - 1, "batch layout changed"
    return spans


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor | None], hidden: torch.Tensor,
                    spans: list[Span], vocab_size: int, device: torch.device, keep: bool,
                    rows_per_pass: int = 512) -> dict:
    """Raw log_softmax logprobs of each next prompt token (and the top k), by request id.
    ``compute_logits`` is the model's LM head: under tensor parallelism every rank calls it (a
    collective), rank 0 alone gets logits back and returns entries (``keep``)."""
    out = {}
    V = vocab_size
    for st, row, start, m in spans:
        k = min(st.sampling_params.prompt_logprobs, V)
        targets = torch.tensor(st.prompt_ids[start + 1:start + m + 1], dtype=torch.long, device=device)
        entries: list = []
        for c in range(0, m, rows_per_pass):
            e = min(m, c + rows_per_pass)
            logits = compute_logits(hidden[row + c:row + e])
            if logits is None:  # a tensor-parallel rank other than 0: it only took part
                continue
            lp = logits.float()[:, :V].log_softmax(dim=-1)
            ids_t, lps_t, ranks_t = gather_logprobs(lp, targets[c:e], k)
            entries.extend(zip(ids_t.tolist(), lps_t.tolist(), ranks_t.tolist()))
        if keep:
            out[st.req_id] = (start, entries)
    return out
