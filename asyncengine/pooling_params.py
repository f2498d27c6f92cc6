"""How a pooling (embedding) request's hidden states become one vector: the spec rides on the
request's SamplingParams to the worker, so it lives at the package root (layers/pooler.py, which
does the pooling, re-exports it)."""
from __future__ import annotations

from typing import Literal

import msgspec

from asyncengine.errors import InvalidRequestError

PoolingType = Literal["last", "mean", "cls"]
POOLING_TYPES: tuple[str, ...] = ("last", "mean", "cls")
POOLING_TASKS: tuple[str, ...] = ("embed", "classify")


class PoolingSpec(msgspec.Struct, frozen=True):
    """How one request's hidden states become its embedding (crosses to the worker)."""
    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    # "classify": the pooled vector goes through the model's classification head (a cross-encoder,
    # a sequence-classification model) and the logits come back instead of an embedding
    task: str = "embed"
    # a (query, document) pair: the position where token type 1 starts (BERT's token_type_ids are
    # 0 up to the first [SEP], 1 after); None = every token has type 0
    token_type_split: int | None = None

    def validated(self, hidden_size: int | None = None) -> "PoolingSpec":
        """Self, or InvalidRequestError naming the bad field."""
        if self.pooling not in POOLING_TYPES:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING_TYPES)}; got {self.pooling!r}")
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"pooling task must be one of {', '.join(POOLING_TASKS)}; got {self.task!r}")
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1:
                raise InvalidRequestError(f"dimensions must be a positive integer; got {self.dimensions!r}")
            if hidden_size is not None and self.dimensions > hidden_size:
                raise InvalidRequestError(
                    f"dimensions={self.dimensions} exceeds the model's embedding size {hidden_size}")
        return self
