"""Decoder sequence-classification models (``Qwen2ForSequenceClassification``,
``LlamaForSequenceClassification``, ``Qwen3ForSequenceClassification``; rerankers converted to a
one-label head): the decoder as it generates, with no LM head, and ``score`` (a bias-free
hidden -> num_labels projection) on the last prompt token's final hidden state, as transformers
computes it for an unpadded sequence. The runner's pooling hands that row to
:meth:`classify_pooled` (worker/pooling.py, ``PoolingSpec(task="classify", pooling="last")``);
being a decoder, it keeps chunked prefill and the prefix cache (last-token pooling needs only the
last row)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from asyncengine.errors import ConfigError
from asyncengine.layers.parallel import FULL, SINGLE, PPGroup, TPGroup
from asyncengine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM


class _SequenceClassification:
    """Mixed into a decoder class: no LM head (the embedding stands in, never used), a ``score`` head."""

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE, pp: PPGroup = FULL) -> None:
        cfg = copy.copy(hf_config)
        cfg.tie_word_embeddings = True  # the checkpoint has no lm_head: do not build one
        super().__init__(cfg, max_positions, tp=tp, pp=pp)
        num_labels = len(getattr(hf_config, "id2label", None) or {}) or getattr(hf_config, "num_labels", 2)
        self.score = nn.Linear(self.args.hidden_size, num_labels, bias=False)

    @classmethod
    def check_tensor_parallel(cls, hf_config, size: int, **_) -> None:
        if size > 1:
            raise ConfigError(f"{cls.__name__} runs with tensor_parallel_size=1 (data_parallel_size scales it out)")

    def classify_pooled(self, rows: torch.Tensor) -> torch.Tensor:
        """Logits [n, num_labels] from the last-token rows [n, H]."""
        return self.score(rows.to(self.score.weight.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """No LM head: the pooling request's one sampled token is dropped anyway."""
        return hidden.new_zeros(hidden.shape[0], self.args.vocab_size)


class LlamaForSequenceClassification(_SequenceClassification, LlamaForCausalLM):
    pass


class Qwen2ForSequenceClassification(_SequenceClassification, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(_SequenceClassification, Qwen3ForCausalLM):
    pass
