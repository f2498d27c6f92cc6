"""N-gram prompt lookup (vLLM's ``ngram`` method): the drafts are what followed the latest earlier
occurrence of the sequence's last n tokens (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``). Free to run, and very good where the answer repeats the prompt (edits,
rewrites, code, extraction)."""
from __future__ import annotations

from asyncengine.spec_decode.proposer import Proposer, Rows


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.k = k

    def propose_step(self, decodes: list, prefills: Rows, specs: Rows) -> list[list[int]]:
        return [self.propose(st.prompt_ids + st.output_ids, k) for st, k in specs]

    def propose(self, tokens: list[int], k: int | None = None) -> list[int]:
        """Up to ``k`` drafts to follow ``tokens`` (possibly none)."""
        k = self.k if k is None else k
        n_tok = len(tokens)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = tokens[n_tok - n:]
            first = suffix[0]
            # latest earlier occurrence whose continuation is known (start < n_tok - n)
            i = n_tok - n - 1
            while i >= 0:
                if tokens[i] == first and tokens[i:i + n] == suffix:
                    return tokens[i + n:i + n + k]
                i -= 1
        return []
