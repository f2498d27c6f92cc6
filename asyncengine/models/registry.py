"""Maps a checkpoint's ``architectures`` entry to our implementation."""
from __future__ import annotations

from asyncengine.errors import ModelLoadError
from asyncengine.models.llama import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                      Qwen3ForCausalLM)

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def resolve_architecture(hf_config) -> type:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for a in archs:
        if a in MODEL_REGISTRY:
            return MODEL_REGISTRY[a]
    raise ModelLoadError(
        f"model architecture {archs or '(none given)'} is not supported; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}")
