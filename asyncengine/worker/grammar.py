"""Structured outputs in the runner: each constrained request's xgrammar matcher (its grammar state
after its outputs) and, each step, one bitmask over the sampled rows that masks the logits to what
each grammar allows before sampling. The compiler is made for the first request with a grammar; the
time spent on masks and matchers is the structured-output overhead (``time_s``, in runner_stats)."""
from __future__ import annotations

import time

import torch

from asyncengine.config.grammar_limits import GrammarLimits
from asyncengine.config.sub_configs import ModelConfig
from asyncengine.worker.grammar_gate import GatedMatcher
from asyncengine.worker.request_state import RunnerRequestState


class Grammar:
    def __init__(self, model_config: ModelConfig, limits: GrammarLimits | None, vocab_size: int,
                 eos_token_ids: list[int]) -> None:
        """``model_config``: whose tokenizer the grammars compile against; ``limits``: what one
        structured output may cost (None: GrammarLimits()'s defaults, as the structured backend's)."""
        self.model_config = model_config
        self.limits = limits
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._compiler = None  # the xgrammar compiler, made on first use
        self.time_s = 0.0

    @property
    def active(self) -> bool:
        """Whether some request has had a grammar (until then :meth:`apply` does nothing)."""
        return self._compiler is not None

    def compiler(self):
        if self._compiler is None:
            from asyncengine.models.model_info import load_model_info  # lazy: only on this path (loading, profiling, a configuration)
            from asyncengine.structured.backend import compiler_for  # lazy: only on this path (loading, profiling, a configuration)

            m = self.model_config
            key = m.tokenizer or m.model
            self._compiler = compiler_for(key, lambda: load_model_info(m).tokenizer, self.vocab_size,
                                          self.eos_token_ids, self.limits)
        return self._compiler

    def start(self, st: RunnerRequestState) -> None:
        """The request's grammar state, replayed over the outputs it already has (a resume). A
        grammar after a reasoning span waits behind its gate (grammar_gate.py)."""
        p = st.sampling_params.structured_outputs
        compiler = self.compiler()  # made even for a gate alone: it allocates the masks
        st.matcher = compiler.matcher(p) if p.has_grammar else None
        if p.after is not None:
            st.matcher = GatedMatcher(st.matcher, p.after, p.reasoning_budget)
        for t in st.output_ids:
            st.matcher.accept(t)

    def accept(self, matcher, token: int) -> None:
        """Advance a request's grammar by the token it sampled (clocked)."""
        tg = time.perf_counter()
        matcher.accept(token)
        self.time_s += time.perf_counter() - tg

    def apply(self, logits: torch.Tensor, sample_states: list[RunnerRequestState], spec_drafts=None) -> None:
        """Mask ``logits`` (one row per sampled row) to what each request's grammar allows; clocked.
        Nothing to do until some request has had a grammar."""
        if self._compiler is None:
            return
        tg = time.perf_counter()
        masked = self.bitmask(sample_states, spec_drafts)
        if masked is not None:
            self._compiler.apply_bitmask(logits, *masked)
        self.time_s += time.perf_counter() - tg

    def bitmask(self, sample_states: list[RunnerRequestState], spec_drafts=None):
        """(bitmask, rows) for the sampled rows whose request has a grammar, or None. ``spec_drafts``
        (first sample index -> drafts): a spec row's i-th row is masked as if its first i drafts
        were accepted (the matcher advances through them, then rolls back)."""
        rows = [j for j, st in enumerate(sample_states) if st.matcher is not None]
        if not rows:
            return None
        bitmask = self.compiler().allocate_bitmask(len(sample_states))
        j = 0
        n_rows = len(sample_states)
        while j < n_rows:
            st = sample_states[j]
            drafts = spec_drafts.get(j) if spec_drafts else None
            if drafts is None:
                if st.matcher is not None:
                    st.matcher.fill(bitmask, j)
                j += 1
                continue
            n = len(drafts) + 1
            if st.matcher is not None:
                advanced = 0
                for i in range(n):
                    st.matcher.fill(bitmask, j + i)
                    if i < len(drafts):
                        if not st.matcher.accept(drafts[i]):
                            # the draft breaks the grammar: the target cannot sample it (masked),
                            # so the rows after it are never accepted; mask them alike
                            for r in range(j + i + 1, j + n):
                                bitmask[r] = bitmask[j + i]
                            break
                        advanced += 1
                st.matcher.rollback(advanced)
            j += n
        return bitmask, rows
