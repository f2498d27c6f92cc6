"""Batched token sampling: one vectorized pass over the whole batch per step (vLLM V1 semantics).

The model runner calls, once per step::

    meta = SamplingMetadata.build(params, prompt_token_ids, output_token_ids, eos_token_ids,
                                  bad_words_token_ids, vocab_size, device, generator)
    out = sampler(logits, meta)            # logits: [B, V] (any float dtype; processed in float32)
    out.sampled_token_ids                  # list[int], one per row

Order of operations (the same as vLLM V1's ``Sampler``):

1. raw logprobs = ``log_softmax(logits)`` for the rows that asked for logprobs. These are the
   model's RAW log-probabilities, taken BEFORE any penalty, bias, mask, temperature or filtering
   (vLLM's default ``logprobs_mode="raw_logprobs"``).
2. ``allowed_token_ids`` (every other token -> -inf), ``bad_words``, ``logit_bias`` (added),
   ``min_tokens`` (EOS ids and ``stop_token_ids`` -> -inf while fewer than ``min_tokens`` tokens
   have been generated; ``ignore_eos`` does not matter here, it only affects stopping).
3. penalties: ``repetition_penalty`` (HF / CTRL definition, over prompt + output tokens: positive
   logits are divided by it, negative ones multiplied), then ``frequency_penalty`` and
   ``presence_penalty`` (OpenAI definition, over output tokens only:
   ``logit -= frequency * count + presence * (count > 0)``).
4. greedy rows (``temperature < 1e-5``) take the argmax of these processed logits.
5. random rows: ``logits / temperature``, then ``min_p`` (drop tokens whose probability is below
   ``min_p * max_prob``), then ``top_k`` and ``top_p`` (smallest set of most likely tokens whose
   mass reaches ``top_p``, always at least one token), then a draw from the renormalized softmax.

Draws are inverse-CDF: one uniform ``u`` per row, and the token is the first (in token-id order)
whose float64 cumulative kept probability exceeds ``u`` times the total. A row whose request has a
``seed`` takes ``u`` from a hash of ``(seed, position)`` only (:func:`seeded_uniform`), where
``position`` is the number of tokens the request had generated before this step: its tokens do not
depend on what else is in the batch, on its slot, nor on the device. Unseeded rows draw ``u`` from
the ``generator`` given to :meth:`SamplingMetadata.build` (the global RNG if ``None``).

When every random row has a ``top_k``, all of this runs on the ``[B, max_k]`` top-k candidates
only; otherwise (``top_p``/``min_p`` without ``top_k``) on the whole vocabulary (with a full sort
for ``top_p``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from asyncengine.errors import InvalidRequestError
from asyncengine.sampling_params import SamplingParams
from asyncengine.worker.cuda_utils import to_host_list

_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")

__all__ = [
    "LogprobsLists",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "gather_logprobs",
    "process_logits",
    "seeded_uniform",
    "validate_token_ids",
]


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform draw in [0, 1) of a seeded request at output position ``position``.

    A splitmix64 hash of ``(seed, position)`` (nearby seeds/positions give unrelated draws), so
    it is the same on every device, in every batch and every slot.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * (1.0 / (1 << 53))


def validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raise :class:`InvalidRequestError` if a token id in ``params`` is outside ``[0, vocab_size)``.

    For the engine's input processing; the sampler itself silently ignores out-of-range ids.
    """
    def check(name: str, ids) -> None:
        for t in ids:
            if not 0 <= t < vocab_size:
                raise InvalidRequestError(f"SamplingParams: {name} contains token id {t}, "
                                          f"outside the vocabulary [0, {vocab_size})")

    if params.logit_bias:
        check("logit_bias", params.logit_bias.keys())
    if params.allowed_token_ids:
        check("allowed_token_ids", params.allowed_token_ids)
    if params.stop_token_ids:
        check("stop_token_ids", params.stop_token_ids)


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


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]
    logprobs: LogprobsLists | None
    # The same ids as a [B] int64 tensor on the logits' device (e.g. to feed the next step).
    sampled_token_ids_tensor: torch.Tensor | None = None


def _plain_greedy(p: SamplingParams, num_output: int, bad_words) -> bool:
    """True for a row that needs nothing but argmax."""
    return (p.temperature < 1e-5 and p.logprobs is None and not p.logit_bias
            and p.allowed_token_ids is None and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and num_output >= p.min_tokens and not bad_words)


def _padded(rows: list[list[int]], device: torch.device, width: int | None = None
            ) -> torch.Tensor:
    """[len(rows), width] int64, each row padded by repeating its last id (0 if it has none)."""
    if width is None:
        width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [r[-1] if r else 0] * (width - len(r)) for r in rows],
                        dtype=torch.int64, device=device)


@dataclass(slots=True)
class SamplingMetadata:
    """Everything the sampler needs for one step, built by :meth:`build`.

    Fields that no row uses are ``None``, so the sampler skips their work entirely.
    """

    num_rows: int
    vocab_size: int
    device: torch.device
    fast_greedy: bool = False  # every row: plain argmax, no logprobs
    all_greedy: bool = False
    # [B, 1] float32 (1.0 on greedy rows); None when all rows are greedy
    temperature: torch.Tensor | None = None
    # [B] bool; None when there are no greedy rows, or all rows are greedy
    greedy_mask: torch.Tensor | None = None
    # top-k / top-p: set when some random row uses either. top_k [B] int64 (vocab_size where
    # disabled, 1 on greedy rows: their draw is discarded anyway), has_top_k [B, 1] bool, top_p
    # [B, 1] float32 (2.0 where disabled: never drops anything). topk_only: every row has k < V.
    top_k: torch.Tensor | None = None
    has_top_k: torch.Tensor | None = None
    topk_only: bool = False
    max_top_k: int = 0
    top_p: torch.Tensor | None = None
    min_p_log: torch.Tensor | None = None  # [B, 1] float32 log(min_p), -inf where disabled
    # the uniform draw of each random row: rows with a seed get seeded_u (float64) at seeded_rows
    seeded_rows: torch.Tensor | None = None
    seeded_u: torch.Tensor | None = None
    any_unseeded_random: bool = False
    # allowed_token_ids: rows [A], and their allowed ids [A, La] (padded with repeats)
    allowed_rows: torch.Tensor | None = None
    allowed_ids: torch.Tensor | None = None
    # logit_bias: (rows, cols, values)
    bias_index: tuple[torch.Tensor, torch.Tensor] | None = None
    bias_values: torch.Tensor | None = None
    # bad words + min_tokens: (rows, cols) set to -inf
    ban_index: tuple[torch.Tensor, torch.Tensor] | None = None
    # penalties, applied sparsely at the [rows, ids] positions (ids padded with repeats of a
    # real id of the same row, so duplicates always write the same value)
    rep_rows: torch.Tensor | None = None  # [R, 1] rows with repetition_penalty != 1
    rep_ids: torch.Tensor | None = None  # [R, L] their prompt + output ids
    repetition_penalty: torch.Tensor | None = None  # [R, 1]
    fp_rows: torch.Tensor | None = None  # [F, 1] rows with frequency/presence penalty and output
    fp_ids: torch.Tensor | None = None  # [F, Lo] their output ids
    presence_penalty: torch.Tensor | None = None  # [F, 1]
    frequency_src: torch.Tensor | None = None  # [F, Lo]: -frequency_penalty, 0 on padding
    generator: torch.Generator | None = None
    # logprobs
    logprob_rows: list[int] = field(default_factory=list)
    logprob_ks: list[int] = field(default_factory=list)  # per logprob row
    logprob_rows_t: torch.Tensor | None = None  # logprob_rows as a tensor; None if every row

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        eos_token_ids: Sequence[int],
        bad_words_token_ids: list[list[list[int]] | None] | None,
        vocab_size: int,
        device: torch.device,
        generator: torch.Generator | None = None,
    ) -> "SamplingMetadata":
        """Build the metadata of one step.

        ``output_token_ids[i]`` are the tokens row ``i`` has generated so far (before this step):
        its length is the seed position and the ``min_tokens`` count, and its contents feed the
        frequency/presence/repetition penalties and bad-word prefixes. ``prompt_token_ids[i]`` is
        only read when row ``i`` has a ``repetition_penalty`` != 1.
        """
        B = len(params)
        V = vocab_size
        device = torch.device(device)
        bw_all = bad_words_token_ids
        # -- hot path: all rows plain greedy ------------------------------------------------------
        if bw_all is None:
            plain = all(_plain_greedy(p, len(o), None) for p, o in zip(params, output_token_ids))
        else:
            plain = all(_plain_greedy(p, len(o), bw)
                        for p, o, bw in zip(params, output_token_ids, bw_all))
        if plain:
            return cls(B, V, device, fast_greedy=True, all_greedy=True)

        meta = cls(B, V, device, generator=generator)
        greedy = [p.temperature < 1e-5 for p in params]
        meta.all_greedy = all(greedy)
        if not meta.all_greedy:
            meta._build_random(params, greedy, output_token_ids)

        allowed_rows: list[int] = []
        allowed_ids: list[list[int]] = []
        bias_r: list[int] = []
        bias_c: list[int] = []
        bias_v: list[float] = []
        ban_r: list[int] = []
        ban_c: list[int] = []
        pen_rows: list[int] = []
        for i, p in enumerate(params):
            out = output_token_ids[i]
            if p.allowed_token_ids is not None:
                allowed_rows.append(i)
                allowed_ids.append([t for t in p.allowed_token_ids if 0 <= t < V])
            if p.logit_bias:
                for t, b in p.logit_bias.items():
                    t = int(t)
                    if 0 <= t < V:
                        bias_r.append(i)
                        bias_c.append(t)
                        bias_v.append(float(b))
            bw = bw_all[i] if bw_all is not None else None
            if bw:
                n_out = len(out)
                for word in bw:
                    if not word:
                        continue
                    k = len(word) - 1
                    if k == 0 or (k <= n_out and out[n_out - k:] == word[:-1]):
                        if 0 <= word[-1] < V:
                            ban_r.append(i)
                            ban_c.append(word[-1])
            if len(out) < p.min_tokens:
                for t in (*eos_token_ids, *(p.stop_token_ids or ())):
                    if 0 <= t < V:
                        ban_r.append(i)
                        ban_c.append(t)
            if (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                    or p.frequency_penalty != 0.0):
                pen_rows.append(i)
            if p.logprobs is not None:
                meta.logprob_rows.append(i)
                meta.logprob_ks.append(min(p.logprobs, V))

        def idx(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=device)

        if meta.logprob_rows and len(meta.logprob_rows) < B:
            meta.logprob_rows_t = idx(meta.logprob_rows)
        if allowed_rows:
            meta.allowed_rows = idx(allowed_rows)
            meta.allowed_ids = _padded(allowed_ids, device)
        if bias_r:
            meta.bias_index = (idx(bias_r), idx(bias_c))
            meta.bias_values = torch.tensor(bias_v, dtype=torch.float32, device=device)
        if ban_r:
            meta.ban_index = (idx(ban_r), idx(ban_c))
        rep_rows = [i for i in pen_rows if params[i].repetition_penalty != 1.0
                    and (prompt_token_ids[i] or output_token_ids[i])]
        if rep_rows:
            meta.rep_rows = idx(rep_rows).unsqueeze(1)
            meta.rep_ids = _padded([[t for t in (*prompt_token_ids[i], *output_token_ids[i])
                                     if 0 <= t < V] for i in rep_rows], device)
            meta.repetition_penalty = torch.tensor(
                [[params[i].repetition_penalty] for i in rep_rows], dtype=torch.float32,
                device=device)
        fp_rows = [i for i in pen_rows if output_token_ids[i] and (
            params[i].presence_penalty != 0.0 or params[i].frequency_penalty != 0.0)]
        if fp_rows:
            outs = [[t for t in output_token_ids[i] if 0 <= t < V] for i in fp_rows]
            width = max(1, max(len(o) for o in outs))
            meta.fp_rows = idx(fp_rows).unsqueeze(1)
            meta.fp_ids = _padded(outs, device, width)
            meta.presence_penalty = torch.tensor(
                [[params[i].presence_penalty] for i in fp_rows], dtype=torch.float32,
                device=device)
            meta.frequency_src = torch.tensor(
                [[-params[i].frequency_penalty] * len(o) + [0.0] * (width - len(o))
                 for i, o in zip(fp_rows, outs)], dtype=torch.float32, device=device)
        return meta

    def _build_random(self, params: list[SamplingParams], greedy: list[bool],
                      output_token_ids: list[list[int]]) -> None:
        V, device = self.vocab_size, self.device
        self.temperature = torch.tensor(
            [[1.0 if g else p.temperature] for p, g in zip(params, greedy)],
            dtype=torch.float32, device=device)
        if any(greedy):
            self.greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
        pg = list(zip(params, greedy))
        any_k = any(not g and 0 < p.top_k < V for p, g in pg)
        any_p = any(not g and p.top_p < 1.0 for p, g in pg)
        if any_k or any_p:
            ks = [1 if g else (p.top_k if 0 < p.top_k < V else V) for p, g in pg]
            self.top_k = torch.tensor(ks, dtype=torch.int64, device=device)
            self.has_top_k = (self.top_k < V).unsqueeze(1)
            self.max_top_k = max((k for k in ks if k < V), default=0)
            self.topk_only = all(k < V for k in ks)
        if any_p:
            self.top_p = torch.tensor([[2.0 if g or p.top_p >= 1.0 else p.top_p] for p, g in pg],
                                      dtype=torch.float32, device=device)
        if any(not g and p.min_p > 0.0 for p, g in zip(params, greedy)):
            self.min_p_log = torch.tensor(
                [[math.log(p.min_p) if (not g and p.min_p > 0.0) else _NEG_INF]
                 for p, g in zip(params, greedy)], dtype=torch.float32, device=device)
        rows: list[int] = []
        us: list[float] = []
        for i, (p, g) in enumerate(zip(params, greedy)):
            if g:
                continue
            if p.seed is not None:
                rows.append(i)
                us.append(seeded_uniform(p.seed, len(output_token_ids[i])))
            else:
                self.any_unseeded_random = True
        if rows:
            self.seeded_u = torch.tensor(us, dtype=torch.float64, device=device)
            self.seeded_rows = torch.tensor(rows, dtype=torch.int64, device=device)

    @property
    def needs_logits_processing(self) -> bool:
        return (self.allowed_rows is not None or self.bias_index is not None
                or self.ban_index is not None or self.rep_rows is not None
                or self.fp_rows is not None)


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
    """Stateless: all per-step state is in :class:`SamplingMetadata`."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        V = meta.vocab_size
        if logits.shape[-1] > V:  # padded vocabulary
            logits = logits[:, :V]
        if meta.fast_greedy:
            ids = logits.argmax(dim=-1)
            return SamplerOutput(to_host_list(ids), None, ids)

        # a private float32 copy: processed in place below, never the caller's tensor
        logits = logits.to(torch.float32, copy=True)
        raw_logprobs = None
        if meta.logprob_rows:
            lp_src = logits if meta.logprob_rows_t is None else \
                logits.index_select(0, meta.logprob_rows_t)
            raw_logprobs = lp_src.log_softmax(dim=-1)
        process_logits(logits, meta)

        if meta.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            greedy_ids = logits.argmax(dim=-1) if meta.greedy_mask is not None else None
            sampled = self._sample_random(logits, meta)
            if greedy_ids is not None:
                sampled = torch.where(meta.greedy_mask, greedy_ids, sampled)

        logprobs = None
        if raw_logprobs is not None:
            rows = meta.logprob_rows
            tok = sampled if meta.logprob_rows_t is None else \
                sampled.index_select(0, meta.logprob_rows_t)
            ids_t, lps_t, ranks_t = gather_logprobs(raw_logprobs, tok, max(meta.logprob_ks))
            ids_l, lps_l, ranks_l = ids_t.tolist(), lps_t.tolist(), ranks_t.tolist()
            B = meta.num_rows
            out_ids: list[list[int] | None] = [None] * B
            out_lps: list[list[float] | None] = [None] * B
            out_ranks: list[int | None] = [None] * B
            for j, (row, k) in enumerate(zip(rows, meta.logprob_ks)):
                out_ids[row] = ids_l[j][:k + 1]
                out_lps[row] = lps_l[j][:k + 1]
                out_ranks[row] = ranks_l[j]
            logprobs = LogprobsLists(out_ids, out_lps, out_ranks)
        return SamplerOutput(to_host_list(sampled), logprobs, sampled)

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
