"""The image settings' checks (EngineConfig: limit_mm_per_prompt, mm_max_pixels,
mm_encoder_cache_tokens, max_num_encoder_input_tokens; docs/multimodal.md)."""
from __future__ import annotations

from asyncengine.errors import ConfigError


def check_multimodal(limit_mm_per_prompt: int, mm_max_pixels: int, mm_encoder_cache_tokens: int) -> None:
    if limit_mm_per_prompt < 0:
        raise ConfigError(f"limit_mm_per_prompt must be >= 0, got {limit_mm_per_prompt}")
    if mm_max_pixels < 1:
        raise ConfigError(f"mm_max_pixels must be >= 1, got {mm_max_pixels}")
    if mm_encoder_cache_tokens < 0:
        raise ConfigError(f"mm_encoder_cache_tokens must be >= 0, got {mm_encoder_cache_tokens}")


def check_encoder_budget(max_num_encoder_input_tokens: int | None) -> None:
    if max_num_encoder_input_tokens is not None and max_num_encoder_input_tokens < 1:
        raise ConfigError(f"max_num_encoder_input_tokens must be >= 1 or None, got {max_num_encoder_input_tokens}")
