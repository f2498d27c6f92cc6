"""The image settings' checks (EngineConfig: limit_mm_per_prompt, mm_max_pixels,
mm_encoder_cache_tokens; docs/multimodal.md)."""
from __future__ import annotations

from asyncengine.errors import ConfigError


def check_multimodal(limit_mm_per_prompt: int, mm_max_pixels: int, mm_encoder_cache_tokens: int) -> None:
    if limit_mm_per_prompt < 0:
        raise ConfigError(f"limit_mm_per_prompt must be >= 0, got {limit_mm_per_prompt}")
    if mm_max_pixels < 1:
        raise ConfigError(f"mm_max_pixels must be >= 1, got {mm_max_pixels}")
    if mm_encoder_cache_tokens < 0:
        raise ConfigError(f"mm_encoder_cache_tokens must be >= 0, got {mm_encoder_cache_tokens}")
