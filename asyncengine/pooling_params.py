"""How a pooling (embedding) request's hidden states become one vector: the spec rides on the
request's SamplingParams to the worker, so it lives at the package root (layers/pooler.py, which
does the pooling, re-exports it)."""
from __future__ import annotations

from typing import Literal

import msgspec

from asyncengine.errors import InvalidRequestError

PoolingType = Literal["last", "mean", "cls"]
POOLING_TYPES: tuple[str, ...] = ("last", "mean", "cls")


class PoolingSpec(msgspec.Struct, frozen=True):
    """How one request's hidden states become its embedding (crosses to the worker)."""
    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def validated(self, hidden_size: int | None = None) -> "PoolingSpec":
        """Self, or InvalidRequestError naming the bad field."""
        if self.pooling not in POOLING_TYPES:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING_TYPES)}; got {self.pooling!r}")
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1:
                raise InvalidRequestError(f"dimensions must be a positive integer; got {self.dimensions!r}")
            if hidden_size is not None and self.dimensions > hidden_size:
                raise InvalidRequestError(
                    f"dimensions={self.dimensions} exceeds the model's embedding size {hidden_size}")
        return self
