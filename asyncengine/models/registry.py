"""Maps a checkpoint's ``architectures`` entry to our implementation.

Names only until a class is asked for: a front end checks the architecture (and fails early on
one we do not run) without importing the model code, which imports torch.

``model_impl`` (EngineConfig): "native" = our own models only; "transformers" = every model
through the Transformers backend (models/transformers_backend.py); "auto" = ours where we have
one, else the Transformers backend when transformers ships the class."""
from __future__ import annotations

import importlib

from asyncengine.errors import ConfigError, ModelLoadError

# architecture -> "module:class"
MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "asyncengine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "asyncengine.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "asyncengine.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "asyncengine.models.llama:Qwen3ForCausalLM",
    "Gemma2ForCausalLM": "asyncengine.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "asyncengine.models.gemma:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "asyncengine.models.gemma:Gemma3ForConditionalGeneration",  # text only
    # vision-language: CLIP tower + projector + our Llama (models/llava.py)
    "LlavaForConditionalGeneration": "asyncengine.models.llava:LlavaForConditionalGeneration",
    # Idefics3 / SmolVLM: SigLIP-shaped tower + pixel-shuffle connector + our Llama (models/idefics3.py)
    "Idefics3ForConditionalGeneration": "asyncengine.models.idefics3:Idefics3ForConditionalGeneration",
    # dynamic-resolution ViT (transformers') + our Qwen2 with M-RoPE (models/qwen2_vl.py)
    "Qwen2VLForConditionalGeneration": "asyncengine.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "asyncengine.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Phi3ForCausalLM": "asyncengine.models.phi3:Phi3ForCausalLM",
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
    # encoders (bidirectional, no KV cache): pooling only (models/pooling_models.py)
    "BertModel": "asyncengine.models.bert_engine:BertForEngine",
    "BertForSequenceClassification": "asyncengine.models.bert_engine:BertForEngine",
    "RobertaModel": "asyncengine.models.bert_engine:BertForEngine",
    "RobertaForSequenceClassification": "asyncengine.models.bert_engine:BertForEngine",
    "XLMRobertaModel": "asyncengine.models.bert_engine:BertForEngine",
    "XLMRobertaForSequenceClassification": "asyncengine.models.bert_engine:BertForEngine",
    # decoders with a classification head (models/seq_cls.py): rerank / classify, embed
    "LlamaForSequenceClassification": "asyncengine.models.seq_cls:LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification": "asyncengine.models.seq_cls:Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification": "asyncengine.models.seq_cls:Qwen3ForSequenceClassification",
}
TRANSFORMERS_BACKEND = "asyncengine.models.transformers_backend:TransformersForCausalLM"
MODEL_IMPLS = ("auto", "native", "transformers")


def _native(hf_config) -> str | None:
    archs = list(getattr(hf_config, "architectures", None) or [])
    return next((a for a in archs if a in MODEL_REGISTRY), None)


def check_architecture(hf_config, model_impl: str = "auto") -> str:
    """The implementation (``module:class``) that runs the config; ModelLoadError if none, a
    ConfigError with the reason where the Transformers backend cannot run it."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    native = _native(hf_config) if model_impl != "transformers" else None
    if native is not None:
        return MODEL_REGISTRY[native]
    if model_impl == "native":
        raise ModelLoadError(
            f"model architecture {archs or '(none given)'} is not supported natively; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))} (model_impl='auto' tries the Transformers backend)")
    from asyncengine.models import transformers_backend  # lazy: imports torch and transformers

    try:
        transformers_backend.check_supported(transformers_backend.as_transformers_config(hf_config))
    except ConfigError as e:
        if model_impl == "transformers":
            raise
        raise ModelLoadError(f"model architecture {archs or '(none given)'} is not supported: not natively "
                             f"(supported: {', '.join(sorted(MODEL_REGISTRY))}), and {e}") from None
    return TRANSFORMERS_BACKEND


def resolve_architecture(hf_config, model_impl: str = "auto") -> type:
    """The model class for the config (imports its module)."""
    module, cls = check_architecture(hf_config, model_impl).split(":")
    return getattr(importlib.import_module(module), cls)
