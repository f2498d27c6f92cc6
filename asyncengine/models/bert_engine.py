"""A BERT encoder (models/bert.py) as the engine's model runner drives a model: built on the meta
device, weights by name, ``forward(input_ids, positions, kv_caches, meta)`` over the step's flat
batch. It has no attention layer the KV cache knows (``layers`` is empty: blocks cost nothing and
only count tokens) and samples nothing real (``compute_logits`` is zeros: a pooling request's one
token is dropped anyway).

Why the step's rows can be split by ``positions == 0``: an encoder's core schedules every prompt
whole, from its first token (models/pooling_models.py turns chunked prefill and the prefix cache
off), so each request's rows are contiguous and start at position 0."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from asyncengine.errors import ConfigError
from asyncengine.layers.parallel import SINGLE, TPGroup
from asyncengine.models.bert import BertEncoder

# RoBERTa's checkpoint names -> BertEncoder's: its classification head is BERT's pooler + classifier
_RENAMES = {"classifier.dense.": "pooler.dense.", "classifier.out_proj.": "classifier."}


def _as_dict(hf_config) -> dict:
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    return dict(vars(hf_config))


class BertForEngine(nn.Module):
    """BertModel (embeddings) or BertForSequenceClassification (cross-encoder logits); RoBERTa and
    XLM-R (Model, ForSequenceClassification) the same way."""

    uses_token_types = True  # the runner passes each row's token type (pairs: worker/pooling.py)

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.check_tensor_parallel(hf_config, tp.size)
        c = _as_dict(hf_config)
        arch = (c.get("architectures") or ["BertModel"])[0]
        num_labels = 0
        if arch.endswith("ForSequenceClassification"):
            num_labels = len(c.get("id2label") or {}) or c.get("num_labels", 2)
        self.bert = BertEncoder(c, with_pooler=bool(num_labels), num_labels=num_labels)
        heads = c["num_attention_heads"]
        self.layers: list = []  # no KV-cache layers
        self.num_heads = self.num_kv_heads = heads
        self.args = SimpleNamespace(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=0,
                                    num_heads=heads, num_kv_heads=heads, head_dim=c["hidden_size"] // heads,
                                    max_positions=max_positions, layer_windows=(), tie_word_embeddings=False)

    @classmethod
    def check_tensor_parallel(cls, hf_config, size: int, **_) -> None:
        if size > 1:
            raise ConfigError("BERT encoders run with tensor_parallel_size=1 (they are small; "
                              "data_parallel_size scales them out)")

    def weight_shard(self, name: str):
        return None

    @property
    def num_labels(self) -> int:
        return 0 if self.bert.classifier is None else self.bert.classifier.out_features

    def load_weights(self, weights) -> None:
        """Strict: a missing or stray tensor is a KeyError (the loader names the checkpoint). A
        BertModel checkpoint's unused pooler is skipped (sentence-transformers never runs it)."""
        state = {}
        for name, t in weights:
            name = name.removeprefix("bert.").removeprefix("roberta.")
            for old, new in _RENAMES.items():
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            if name.endswith("position_ids") or (self.bert.pooler is None and name.startswith("pooler.")):
                continue
            state[name] = t
        mine = self.bert.state_dict()
        missing, stray = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        if missing or stray:
            raise KeyError(f"missing {missing[:5]}, unexpected {stray[:5]}")
        with torch.no_grad():
            for name, t in state.items():
                if mine[name].shape != t.shape:
                    raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(mine[name].shape)}")
                mine[name].copy_(t)
        self.bert.prepare()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches=None, meta=None,
                token_type_ids: torch.Tensor | None = None, **_) -> torch.Tensor:
        starts = torch.nonzero(positions == 0).flatten()
        qsl = torch.cat([starts, starts.new_tensor([input_ids.shape[0]])])
        return self.bert(input_ids, qsl, token_type_ids)

    def classify_pooled(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """Logits [n, num_labels] from the [CLS] rows [n, H] (the tanh pooler, then the classifier)."""
        b = self.bert
        return b.classifier(torch.tanh(b.pooler.dense(cls_rows.to(b.classifier.weight.dtype))))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_zeros(hidden.shape[0], self.args.vocab_size)
