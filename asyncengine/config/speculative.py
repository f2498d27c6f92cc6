"""SpeculativeConfig: vLLM's field names (``method``, ``num_speculative_tokens``,
``prompt_lookup_min``, ``prompt_lookup_max``, ``model``)."""
from __future__ import annotations

import dataclasses

from asyncengine.errors import ConfigError

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    # ngram: the longest suffix of n tokens (max down to min) that occurred before is looked up
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # draft_model: a smaller model with the same tokenizer (path or name, like EngineConfig.model)
    model: str | None = None

    @classmethod
    def from_dict(cls, d: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        d = dict(d)
        if "method" not in d:  # vLLM infers: a model means a draft model
            d["method"] = "draft_model" if d.get("model") else "ngram"
        if d["method"] == "draft":
            d["method"] = "draft_model"
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(names)}")
        return cls(**d)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ConfigError("speculative_config.num_speculative_tokens must be in [1, 32], "
                              f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError("speculative_config: method 'draft_model' needs 'model' (the draft's path)")
