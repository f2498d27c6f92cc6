"""Speculative decoding in the runner: the step's drafts, and which of them the target accepts.

A request the scheduler gave k draft slots is laid out like a prefill chunk of 1 + k' tokens (its
last token and the k' <= k drafts the proposer made) and every one of those rows is sampled, row i
as if the drafts before it were already outputs (same penalties, same seeded draw position).
Drafts are accepted while they equal the target's own sample; the first mismatch (or the bonus row
after the last draft) gives the target's token. The drafts are point masses (n-gram lookup, greedy
draft model), and for those this *is* rejection sampling: the output follows the target
distribution exactly, and a seeded request gets the very tokens it would get without speculation.
The request's true position moves by the number accepted; the KV of rejected drafts sits past it
and is overwritten by the next step.
"""
from __future__ import annotations

import torch

from asyncengine.config.speculative import SpeculativeConfig
from asyncengine.spec_decode.proposer import Proposer
from asyncengine.worker.request_state import RunnerRequestState
from asyncengine.worker.sampler import LogprobsLists

Drafted = list[tuple[RunnerRequestState, list[int]]]  # (state, its drafts) of each spec row


def make_proposer(spec: SpeculativeConfig, draft_model: torch.nn.Module | None, num_blocks: int,
                  block_size: int, device: torch.device, dtype: torch.dtype, backend_name: str) -> Proposer:
    """The proposer ``spec.method`` names (spec_decode/proposer.py: one interface for all)."""
    if spec.method == "ngram":
        from asyncengine.spec_decode.ngram import NgramProposer  # lazy: only the configured proposer loads

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens)
    from asyncengine.spec_decode.draft import DraftModelProposer  # lazy: only the configured proposer loads

    assert draft_model is not None, "speculative_config method 'draft_model' needs the draft loaded"
    return DraftModelProposer(draft_model, num_blocks, block_size, device, dtype, backend_name)


def propose_drafts(proposer: Proposer, decodes: list[RunnerRequestState],
                   prefills: list[tuple[RunnerRequestState, int]],
                   specs: list[tuple[RunnerRequestState, int]]) -> Drafted:
    """Drafts for the rows given draft slots (``specs``: (state, k)), paired with their states.
    Call before the computed counts advance."""
    drafts = proposer.propose_step(decodes, prefills, specs)
    return [(st, d) for (st, _), d in zip(specs, drafts)]


def draft_outputs(sample_states: list[RunnerRequestState], specs: Drafted,
                  spec_rows: list[tuple[int, int]]) -> list[list[int]]:
    """The outputs each sampled row is sampled after: a spec row's i-th row as if its first i
    drafts were outputs (``spec_rows``: (first sample index, count) of each spec row)."""
    outputs = [st.output_ids for st in sample_states]
    for (st, drafts), (first, n) in zip(specs, spec_rows):
        for i in range(1, n):
            outputs[first + i] = st.output_ids + drafts[:i]
    return outputs


def accept_drafts(sampled: list[int], lp: LogprobsLists | None, sample_states: list[RunnerRequestState],
                  specs: Drafted, spec_rows: list[tuple[int, int]], proposer: Proposer):
    """Accept each spec row's drafts up to the first one that differs from the target's sample,
    and advance every sampled request by what it accepted (outputs, true position, grammar, the
    proposer's state). Returns (req ids, accepted tokens, their logprobs, drafts verified) by
    request, as ModelRunnerOutput has them."""
    row_lps = None if lp is None else [None if ids is None else (ids, vals, rank) for ids, vals, rank in
                                       zip(lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks)]
    spec_first = {first: (st, drafts, n) for (st, drafts), (first, n) in zip(specs, spec_rows)}
    req_ids: list[str] = []
    toks_out: list[list[int]] = []
    lps_out: list | None = [] if row_lps is not None else None
    num_drafts: list[int] = []
    j = 0
    while j < len(sampled):
        st = sample_states[j]
        hit = spec_first.get(j)
        if hit is None:
            acc = [sampled[j]]
            num_drafts.append(0)
            count = 1
        else:
            _, drafts, count = hit
            acc = []
            for i in range(count):
                acc.append(sampled[j + i])
                if i == len(drafts) or sampled[j + i] != drafts[i]:
                    break
            num_drafts.append(len(drafts))
            start = st.num_computed_tokens
            st.num_computed_tokens = start + len(acc)
            if drafts:
                proposer.accepted(st.req_id, start, len(acc), len(drafts))
        st.output_ids.extend(acc)
        if st.matcher is not None:
            for t in acc:
                st.matcher.accept(t)
        req_ids.append(st.req_id)
        toks_out.append(acc)
        if lps_out is not None:
            e = row_lps[j:j + len(acc)]
            lps_out.append(None if e[0] is None else e)
        j += count
    return req_ids, toks_out, lps_out, num_drafts
