"""Batched token sampling: one vectorized pass over the whole batch per step (vLLM V1 semantics).

The model runner calls, once per step::

    meta = sampling_batch.metadata(states)  # worker/sampling_batch.py, or SamplingMetadata.build(...)
    out = sampler(logits, meta)            # logits: [B, V] (any float dtype; processed in float32)
    out.sampled_token_ids                  # list[int], one per row
    out.logprobs                           # worked out on first read, after the ids are handed on

Order of operations (the same as vLLM V1's ``Sampler``):

1. raw logprobs = ``log_softmax(logits)`` for the rows that asked for logprobs. These are the
   model's RAW log-probabilities, taken BEFORE any penalty, bias, mask, temperature or filtering
   (vLLM's default ``logprobs_mode="raw_logprobs"``): those rows' logits are kept aside, and
   their logprobs computed when :attr:`SamplerOutput.logprobs` is first read.
2. ``allowed_token_ids`` (every other token -> -inf), ``bad_words``, ``logit_bias`` (added),
   ``min_tokens`` (EOS ids and ``stop_token_ids`` -> -inf while fewer than ``min_tokens`` tokens
   have been generated; ``ignore_eos`` does not matter here, it only affects stopping).
3. penalties: ``repetition_penalty`` (HF / CTRL definition, over prompt + output tokens: positive
   logits are divided by it, negative ones multiplied), then ``frequency_penalty`` and
   ``presence_penalty`` (OpenAI definition, over output tokens only:
   ``logit -= frequency * count + presence * (count > 0)``).
4. greedy rows (``temperature < 1e-5``) take the argmax of these processed logits
   (worker/sampler_ops.py: exact, the first maximal index, as fast as a max); a batch of plain
   greedy rows takes it straight from the model's logits, in their dtype.
5. random rows: ``logits / temperature``, then ``min_p`` (drop tokens whose probability is below
   ``min_p * max_prob``), then ``top_k`` and ``top_p`` (smallest set of most likely tokens whose
   mass reaches ``top_p``, always at least one token), then a draw from the renormalized softmax.

Draws are inverse-CDF: one uniform ``u`` per row, and the token is the first (in token-id order)
whose float64 cumulative kept probability exceeds ``u`` times the total. A row whose request has a
``seed`` takes ``u`` from a hash of ``(seed, position)`` only (:func:`seeded_uniform`), where
``position`` is the number of tokens the request had generated before this step: its tokens do not
depend on what else is in the batch, on its slot, nor on the device. Unseeded rows draw ``u`` from
the ``generator`` given to :meth:`SamplingMetadata.build` (the global RNG if ``None``).

The per-step tables live in :class:`~asyncengine.worker.sampling_metadata.SamplingMetadata`.
When every random row has a ``top_k``, all of this runs on the ``[B, max_k]`` top-k candidates
only; otherwise (``top_p``/``min_p`` without ``top_k``) on the whole vocabulary (with a full sort
for ``top_p``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from asyncengine.worker.cuda_utils import to_host_list
from asyncengine.worker.sampler_ops import argmax_rows
from asyncengine.worker.sampling_metadata import SamplingMetadata

_NEG_INF = float("-inf")

__all__ = ["LogprobsLists", "Sampler", "SamplerOutput", "gather_logprobs", "process_logits"]


class LogprobsLists(NamedTuple):
    """Per-row sample logprobs; entry ``i`` is ``None`` for rows that did not ask for logprobs.

    For a row with ``logprobs=k``: ``logprob_token_ids[i]`` is ``[sampled, top1, ..., topk]``
    (the sampled token first, then the k most likely tokens; the sampled token may appear twice),
    ``logprobs[i]`` their raw log-probabilities, ``sampled_token_ranks[i]`` the 1-based rank of the
    sampled token under the raw distribution (``1`` = most likely; ties share the worse rank).
    """

    logprob_token_ids: list[list[int] | None]
    logprobs: list[list[float] | None]
    sampled_token_ranks: list[int | None]


class SamplerOutput:
    """The sampled ids (a list, and a [B] int64 tensor on the logits' device to feed the next
    step) and the logprobs of the rows that asked.

    The logprobs are worked out on first read of :attr:`logprobs`, not by the sampler: the runner
    hands the ids on (appends them to its requests, broadcasts them to the other ranks) first,
    and a step where no row asked reads ``None`` at no cost.
    """

    __slots__ = ("sampled_token_ids", "sampled_token_ids_tensor", "_logprobs", "_pending")

    def __init__(self, sampled_token_ids: list[int], logprobs: LogprobsLists | None = None,
                 sampled_token_ids_tensor: torch.Tensor | None = None, pending=None) -> None:
        self.sampled_token_ids = sampled_token_ids
        self.sampled_token_ids_tensor = sampled_token_ids_tensor
        self._logprobs = logprobs
        self._pending = pending  # (raw logits of the logprob rows, their sampled ids, metadata)

    @property
    def logprobs(self) -> LogprobsLists | None:
        if self._pending is not None:
            self._logprobs = _logprobs_lists(*self._pending)
            self._pending = None
        return self._logprobs


def _logprobs_lists(raw: torch.Tensor, tok: torch.Tensor, meta: SamplingMetadata) -> LogprobsLists:
    """The raw log-probabilities of the logprob rows (``raw``: their unprocessed logits) as
    per-row lists: the sampled token ``tok`` first, then the top ``k`` of each row."""
    ids_t, lps_t, ranks_t = gather_logprobs(raw.log_softmax(dim=-1), tok, max(meta.logprob_ks))
    ids_l, lps_l, ranks_l = ids_t.tolist(), lps_t.tolist(), ranks_t.tolist()
    B = meta.num_rows
    out_ids: list[list[int] | None] = [None] * B
    out_lps: list[list[float] | None] = [None] * B
    out_ranks: list[int | None] = [None] * B
    for j, (row, k) in enumerate(zip(meta.logprob_rows, meta.logprob_ks)):
        out_ids[row] = ids_l[j][:k + 1]
        out_lps[row] = lps_l[j][:k + 1]
        out_ranks[row] = ranks_l[j]
    return LogprobsLists(out_ids, out_lps, out_ranks)

def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From log-probabilities ``[N, V]`` and chosen ``token_ids [N]``: ``(ids [N, k+1],
    logprobs [N, k+1], ranks [N])``: the chosen token first, then the top ``k``; ``ranks`` is the
    1-based rank of the chosen token. Also usable for prompt logprobs."""
    token_ids = token_ids.to(torch.int64).unsqueeze(-1)
    tok_lp = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= tok_lp).sum(-1)
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        return torch.cat([token_ids, top_ids], -1), torch.cat([tok_lp, top_lp], -1), ranks
    return token_ids, tok_lp, ranks


_TOP_P_CANDIDATES = 256


def _apply_min_p(logits: torch.Tensor, max_logit: torch.Tensor, min_p_log: torch.Tensor) -> None:
    """-inf (in place) where prob < min_p * max_prob, i.e. logit < max_logit + log(min_p)."""
    logits.masked_fill_(logits < max_logit + min_p_log, _NEG_INF)


def _top_p_sorted_desc(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Zero (in place) the tail of descending-sorted ``probs`` [B, n] beyond the top-``p`` nucleus:
    a token is kept iff the mass strictly above it is < p (so the most likely token always is).
    This is vLLM's rule (drop where the ascending inclusive cumsum is <= 1 - p)."""
    above = probs.cumsum(dim=-1).sub_(probs)
    return probs.masked_fill_(above >= p, 0.0)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index [B, 1] of the token drawn from unnormalized ``probs`` [B, n] with uniforms ``u`` [B, 1]:
    the first index whose float64 cumulative mass exceeds ``u * total`` (never a 0-mass token)."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return idx.clamp_(max=probs.shape[-1] - 1)


class Sampler:
    """Stateless: all per-step state is in :class:`SamplingMetadata`.

    ``owned=True``: the caller hands ``logits`` over (a fresh float32 tensor it no longer reads),
    so they are processed in place instead of in a private copy."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, owned: bool = False) -> SamplerOutput:
        V = meta.vocab_size
        if logits.shape[-1] > V:  # padded vocabulary
            logits = logits[:, :V]
        if meta.fast_greedy:  # any dtype: argmax_rows compares bf16 as exactly as float32
            ids = argmax_rows(logits)
            return SamplerOutput(to_host_list(ids), None, ids)

        # float32, processed in place below: a private copy unless the caller handed them over
        owned = owned and logits.dtype == torch.float32 and logits.is_contiguous()
        logits = logits.to(torch.float32, copy=not owned)
        raw = None  # the logprob rows' logits before processing (their logprobs come later)
        if meta.logprob_rows:
            raw = logits.clone() if meta.logprob_rows_t is None else logits.index_select(0, meta.logprob_rows_t)
        process_logits(logits, meta)

        if meta.all_greedy:
            sampled = argmax_rows(logits)
        else:
            greedy_ids = argmax_rows(logits) if meta.greedy_mask is not None else None
            sampled = self._sample_random(logits, meta)
            if greedy_ids is not None:
                sampled = torch.where(meta.greedy_mask, greedy_ids, sampled)

        ids = to_host_list(sampled)
        if raw is None:
            return SamplerOutput(ids, None, sampled)
        tok = sampled if meta.logprob_rows_t is None else sampled.index_select(0, meta.logprob_rows_t)
        return SamplerOutput(ids, None, sampled, pending=(raw, tok, meta))

    @staticmethod
    def _uniforms(meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
        """[B, 1] float64 uniforms: shared generator for unseeded rows, hashes for seeded ones."""
        if meta.any_unseeded_random:
            g = meta.generator
            u = torch.rand(meta.num_rows, dtype=torch.float64, generator=g,
                           device=g.device if g is not None else device).to(device)
            if meta.seeded_rows is not None:
                u.index_copy_(0, meta.seeded_rows, meta.seeded_u)
        elif meta.seeded_rows is not None and len(meta.seeded_rows) == meta.num_rows:
            u = meta.seeded_u
        else:  # only greedy rows besides the seeded ones: their value does not matter
            u = torch.zeros(meta.num_rows, dtype=torch.float64, device=device)
            u.index_copy_(0, meta.seeded_rows, meta.seeded_u)
        return u.unsqueeze(1)

    @classmethod
    def _sample_random(cls, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p, then one inverse-CDF draw per row.

        The CDF runs over the kept tokens in token-id order (float64), so a row's token depends
        only on its kept probabilities and its uniform, whichever code path the batch takes.

        Top-k/top-p avoid sorting the vocabulary: they work on the top ``max(k, 256)`` candidates
        of each row. A row without top-k whose candidates hold less than ``top_p`` of the mass
        (a flat distribution) is redone exactly on the whole vocabulary, with a full sort.
        """
        u = cls._uniforms(meta, logits.device)
        if meta.top_k is None:  # no top-k / top-p anywhere
            logits.div_(meta.temperature)
            if meta.min_p_log is not None:
                _apply_min_p(logits, logits.amax(dim=-1, keepdim=True), meta.min_p_log)
            return _inverse_cdf(logits.softmax(dim=-1), u).squeeze(1)

        V = logits.shape[-1]
        covered = None
        if meta.topk_only:
            # temperature keeps the order: select first, then scale the candidates only
            vals, ids = logits.topk(meta.max_top_k, dim=-1)  # descending
            vals.div_(meta.temperature)
            pos = torch.arange(vals.shape[1], device=vals.device)
            vals.masked_fill_(pos >= meta.top_k.unsqueeze(1), _NEG_INF)
            if meta.min_p_log is not None:
                _apply_min_p(vals, vals[:, :1], meta.min_p_log)
            probs = vals.softmax(dim=-1)
        else:
            logits.div_(meta.temperature)
            if meta.min_p_log is not None:
                _apply_min_p(logits, logits.amax(dim=-1, keepdim=True), meta.min_p_log)
            n_cand = min(V, max(_TOP_P_CANDIDATES, meta.max_top_k))
            vals, ids = logits.topk(n_cand, dim=-1)  # descending
            pos = torch.arange(n_cand, device=vals.device)
            vals.masked_fill_(pos >= meta.top_k.unsqueeze(1), _NEG_INF)
            # normalize over the row's top-k (all among the candidates), else the whole vocab
            norm = torch.where(meta.has_top_k, vals.logsumexp(dim=-1, keepdim=True),
                               logits.logsumexp(dim=-1, keepdim=True))
            probs = vals.sub_(norm).exp_()
            covered = meta.has_top_k.squeeze(1)
            if meta.top_p is not None:
                covered = covered | (probs.sum(dim=-1) >= meta.top_p.squeeze(1))
        if meta.top_p is not None:
            _top_p_sorted_desc(probs, meta.top_p)
        order = ids.argsort(dim=-1)  # draw in token-id order
        pick = order.gather(1, _inverse_cdf(probs.gather(1, order), u))
        sampled = ids.gather(1, pick).squeeze(1)

        if covered is not None and not bool(covered.all()):
            rows = (~covered).nonzero().squeeze(1)
            sub = logits.index_select(0, rows)  # tempered, min-p applied; these have no top-k
            sub_p = meta.top_p.index_select(0, rows) if meta.top_p is not None else None
            if sub_p is not None and bool((sub_p <= 1.0).any()):
                svals, sids = sub.sort(dim=-1, descending=True)
                sprobs = _top_p_sorted_desc(svals.softmax(dim=-1), sub_p)
                full = torch.zeros_like(sprobs).scatter_(1, sids, sprobs)
            else:
                full = sub.softmax(dim=-1)
            sampled.index_copy_(0, rows, _inverse_cdf(full, u.index_select(0, rows)).squeeze(1))
        return sampled


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Apply, in place on float32 ``logits`` [B, V], everything that also changes the greedy
    choice: ``allowed_token_ids``, ``logit_bias``, bad words and ``min_tokens`` bans, then the
    repetition, presence and frequency penalties. Returns ``logits``."""
    if meta.allowed_rows is not None:
        r, ids = meta.allowed_rows.unsqueeze(1), meta.allowed_ids
        kept = logits[r, ids]
        logits.index_fill_(0, meta.allowed_rows, _NEG_INF)
        if meta.allowed_ids.shape[1]:
            logits[r, ids] = kept
    if meta.bias_index is not None:
        logits.index_put_(meta.bias_index, meta.bias_values, accumulate=True)
    if meta.ban_index is not None:
        logits.index_put_(meta.ban_index, torch.tensor(_NEG_INF, device=logits.device))
    if meta.rep_rows is not None:
        r, ids, rep = meta.rep_rows, meta.rep_ids, meta.repetition_penalty
        vals = logits[r, ids]
        logits[r, ids] = torch.where(vals > 0, vals / rep, vals * rep)
    if meta.fp_rows is not None:
        r, ids = meta.fp_rows, meta.fp_ids
        logits[r, ids] = logits[r, ids] - meta.presence_penalty
        logits.index_put_((r.expand_as(ids), ids), meta.frequency_src, accumulate=True)
    return logits
