"""Maps a checkpoint's ``architectures`` entry to our implementation.

Names only until a class is asked for: a front end checks the architecture (and fails early on
one we do not run) without importing the model code, which imports torch."""
from __future__ import annotations

import importlib

from asyncengine.errors import ModelLoadError

# architecture -> "module:class"
MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "asyncengine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "asyncengine.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "asyncengine.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "asyncengine.models.llama:Qwen3ForCausalLM",
    # mixture of experts (models/moe.py)
    "MixtralForCausalLM": "asyncengine.models.moe:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "asyncengine.models.moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "asyncengine.models.moe:Qwen3MoeForCausalLM",
    "OlmoeForCausalLM": "asyncengine.models.moe:OlmoeForCausalLM",
    "GraniteMoeForCausalLM": "asyncengine.models.moe:GraniteMoeForCausalLM",
    # hybrids: Mamba2 state-space layers (a state slot per request) beside attention
    "Mamba2ForCausalLM": "asyncengine.models.mamba2:Mamba2ForCausalLM",
    "BambaForCausalLM": "asyncengine.models.bamba:BambaForCausalLM",
    "GraniteMoeHybridForCausalLM": "asyncengine.models.bamba:GraniteMoeHybridForCausalLM",
    "NemotronHForCausalLM": "asyncengine.models.nemotron_h:NemotronHForCausalLM",
}


def check_architecture(hf_config) -> str:
    """The first of the config's ``architectures`` we run; ModelLoadError if none."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for a in archs:
        if a in MODEL_REGISTRY:
            return a
    raise ModelLoadError(
        f"model architecture {archs or '(none given)'} is not supported; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}")


def resolve_architecture(hf_config) -> type:
    """The model class for the config (imports its module)."""
    module, cls = MODEL_REGISTRY[check_architecture(hf_config)].split(":")
    return getattr(importlib.import_module(module), cls)
