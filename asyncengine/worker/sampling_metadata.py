"""What the sampler needs for one step, built once per step from the batch's requests: which
rows are plain greedy, padded id tables for allowed tokens, bans, biases and penalties, per-row
temperature / top-k / top-p / min-p, and the uniform draw of every random row (seeded rows from a
hash of (seed, position), so a request's tokens do not depend on its batch). Fields no row uses
stay ``None``, so the sampler (``worker/sampler.py``) skips their work."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from asyncengine.errors import InvalidRequestError
from asyncengine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")


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
    # what build_static leaves for for_step: the rows' params and EOS ids, and which rows need
    # per-step work (seeded draws, min_tokens and bad-word bans, penalties)
    _pen_params: list[SamplingParams] = field(default_factory=list)
    _eos: tuple[int, ...] = ()
    _plain: bool = False  # every row plain greedy while its outputs reach min_tokens
    _seeds: list[tuple[int, int]] = field(default_factory=list)  # (row, seed)
    _min_tok_rows: list[int] = field(default_factory=list)
    _bad_rows: list[tuple[int, list[list[int]]]] = field(default_factory=list)  # (row, bad words)
    _pen_rows: list[int] = field(default_factory=list)

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
        """Build the metadata of one step: :meth:`build_static`, then :meth:`for_step` with the
        penalties' tables made from the token lists.

        ``output_token_ids[i]`` are the tokens row ``i`` has generated so far (before this step):
        its length is the seed position and the ``min_tokens`` count, and its contents feed the
        frequency/presence/repetition penalties and bad-word prefixes. ``prompt_token_ids[i]`` is
        only read when row ``i`` has a ``repetition_penalty`` != 1.
        """
        static = cls.build_static(params, bad_words_token_ids, eos_token_ids, vocab_size, device, generator)
        return static.for_step(output_token_ids, lambda meta: meta._build_penalties(
            params, prompt_token_ids, output_token_ids))

    @classmethod
    def build_static(cls, params: list[SamplingParams], bad_words_token_ids, eos_token_ids: Sequence[int],
                     vocab_size: int, device: torch.device, generator: torch.Generator | None = None
                     ) -> "SamplingMetadata":
        """What depends only on the rows' parameters (kept while a batch's rows stay the same):
        per-row temperature / top-k / top-p / min-p, allowed ids, biases, logprob rows, and which
        rows need per-step work (seeds, bans, penalties)."""
        B, device = len(params), torch.device(device)
        bw_all = bad_words_token_ids
        meta = cls(B, vocab_size, device, generator=generator)
        meta._pen_params = params
        meta._eos = tuple(eos_token_ids)
        meta._min_tok_rows = [i for i, p in enumerate(params) if p.min_tokens > 0]
        meta._bad_rows = [] if bw_all is None else [(i, bw) for i, bw in enumerate(bw_all) if bw]
        meta._plain = all(_plain_greedy(p, p.min_tokens, None) for p in params) and not meta._bad_rows
        if meta._plain:  # only min_tokens can still stop a step from being plain argmax
            return meta
        greedy = [p.temperature < 1e-5 for p in params]
        meta.all_greedy = all(greedy)
        if not meta.all_greedy:
            meta._build_random(params, greedy)
        meta._collect_static_rules(params)
        return meta

    def for_step(self, output_token_ids: Sequence[list[int]], penalties) -> "SamplingMetadata":
        """This step's metadata: a copy of the static one with the seeded draws, the bans (bad
        words, EOS before ``min_tokens``) and the penalties' tables (``penalties(meta)`` fills
        them) of the rows' current outputs. Only the rows that need them read their outputs
        (``output_token_ids[i]``), so a plain batch costs no pass over its rows."""
        B, V, device = self.num_rows, self.vocab_size, self.device
        if self._plain and all(len(output_token_ids[i]) >= self._pen_params[i].min_tokens
                               for i in self._min_tok_rows):
            return SamplingMetadata(B, V, device, fast_greedy=True, all_greedy=True)
        meta = copy.copy(self)
        if self._plain:  # plain but for min_tokens: every static table is empty
            meta.all_greedy = True
            meta._plain = False
        if meta._seeds:
            meta.seeded_u = torch.tensor([seeded_uniform(seed, len(output_token_ids[i])) for i, seed in meta._seeds],
                                         dtype=torch.float64, device=device)
        ban_r: list[int] = []
        ban_c: list[int] = []
        for i, words in self._bad_rows:
            out = output_token_ids[i]
            n_out = len(out)
            for word in words:
                if not word:
                    continue
                k = len(word) - 1
                if (k == 0 or (k <= n_out and out[n_out - k:] == word[:-1])) and 0 <= word[-1] < V:
                    ban_r.append(i)
                    ban_c.append(word[-1])
        for i in self._min_tok_rows:
            p = self._pen_params[i]
            if len(output_token_ids[i]) < p.min_tokens:
                for t in (*self._eos, *(p.stop_token_ids or ())):
                    if 0 <= t < V:
                        ban_r.append(i)
                        ban_c.append(t)
        if ban_r:
            meta.ban_index = (torch.tensor(ban_r, dtype=torch.int64, device=device),
                              torch.tensor(ban_c, dtype=torch.int64, device=device))
        if meta._pen_rows:
            penalties(meta)
        return meta

    def _collect_static_rules(self, params: list[SamplingParams]) -> None:
        """One pass over the rows: allowed ids, logit bias, penalty rows and logprob rows."""
        V, device = self.vocab_size, self.device
        allowed_rows: list[int] = []
        allowed_ids: list[list[int]] = []
        bias_r: list[int] = []
        bias_c: list[int] = []
        bias_v: list[float] = []
        for i, p in enumerate(params):
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
            if (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                    or p.frequency_penalty != 0.0):
                self._pen_rows.append(i)
            if p.logprobs is not None:
                self.logprob_rows.append(i)
                self.logprob_ks.append(min(p.logprobs, V))

        def idx(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=device)

        if self.logprob_rows and len(self.logprob_rows) < self.num_rows:
            self.logprob_rows_t = idx(self.logprob_rows)
        if allowed_rows:
            self.allowed_rows = idx(allowed_rows)
            self.allowed_ids = _padded(allowed_ids, device)
        if bias_r:
            self.bias_index = (idx(bias_r), idx(bias_c))
            self.bias_values = torch.tensor(bias_v, dtype=torch.float32, device=device)

    def _build_penalties(self, params: list[SamplingParams], prompt_token_ids, output_token_ids) -> None:
        """The repetition, presence and frequency penalties' index and value tensors, from the
        rows' token lists (worker/penalty_history.py keeps them on the device instead)."""
        V, device = self.vocab_size, self.device
        pen_rows = self._pen_rows
        rep_rows = [i for i in pen_rows if params[i].repetition_penalty != 1.0
                    and (prompt_token_ids[i] or output_token_ids[i])]
        if rep_rows:
            self.rep_rows = torch.tensor(rep_rows, dtype=torch.int64, device=device).unsqueeze(1)
            self.rep_ids = _padded([[t for t in (*prompt_token_ids[i], *output_token_ids[i])
                                     if 0 <= t < V] for i in rep_rows], device)
            self.repetition_penalty = torch.tensor(
                [[params[i].repetition_penalty] for i in rep_rows], dtype=torch.float32,
                device=device)
        fp_rows = [i for i in pen_rows if output_token_ids[i] and (
            params[i].presence_penalty != 0.0 or params[i].frequency_penalty != 0.0)]
        if fp_rows:
            outs = [[t for t in output_token_ids[i] if 0 <= t < V] for i in fp_rows]
            width = max(1, max(len(o) for o in outs))
            self.fp_rows = torch.tensor(fp_rows, dtype=torch.int64, device=device).unsqueeze(1)
            self.fp_ids = _padded(outs, device, width)
            self.presence_penalty = torch.tensor(
                [[params[i].presence_penalty] for i in fp_rows], dtype=torch.float32,
                device=device)
            self.frequency_src = torch.tensor(
                [[-params[i].frequency_penalty] * len(o) + [0.0] * (width - len(o))
                 for i, o in zip(fp_rows, outs)], dtype=torch.float32, device=device)

    def _build_random(self, params: list[SamplingParams], greedy: list[bool]) -> None:
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
        self._seeds = [(i, p.seed) for i, (p, g) in enumerate(pg) if not g and p.seed is not None]
        self.any_unseeded_random = any(not g and p.seed is None for p, g in pg)
        if self._seeds:
            self.seeded_rows = torch.tensor([i for i, _ in self._seeds], dtype=torch.int64, device=device)

    @property
    def needs_logits_processing(self) -> bool:
        return (self.allowed_rows is not None or self.bias_index is not None
                or self.ban_index is not None or self.rep_rows is not None
                or self.fp_rows is not None)
