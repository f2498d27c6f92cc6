"""What a model can be asked for (vLLM's ``supported_tasks``: "generate", "embed", "classify"), from
its architecture and ``EngineConfig.runner``, without torch: the front end refuses a request the
model cannot serve (a generative model asked to rerank, an encoder asked to generate) before it
reaches a worker, and the engine core gives an encoder the scheduling it needs.

An encoder (BERT) attends both ways over its whole prompt and keeps no KV cache: each prompt must
run in one step (no chunked prefill) and from its first token (no prefix cache), so its core runs
with both off and a token budget of at least one full-length prompt (:func:`encoder_engine_config`).
"""
from __future__ import annotations

import dataclasses

from asyncengine.config.runner import check_runner
from asyncengine.errors import ConfigError, InvalidRequestError, ModelLoadError

# encoder architectures (models/bert_engine.py) -> the tasks they serve
ENCODER_TASKS: dict[str, tuple[str, ...]] = {
    "BertModel": ("embed",),
    "BertForSequenceClassification": ("classify", "embed"),
    "RobertaModel": ("embed",),
    "RobertaForSequenceClassification": ("classify", "embed"),
    "XLMRobertaModel": ("embed",),
    "XLMRobertaForSequenceClassification": ("classify", "embed"),
}
# decoders with a classification head instead of an LM head (models/seq_cls.py): last-token pooled
DECODER_CLASSIFIERS = ("LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
                       "Qwen3ForSequenceClassification")


def architecture(hf_config) -> str | None:
    archs = list(getattr(hf_config, "architectures", None) or ())
    return archs[0] if archs else None


def is_encoder(hf_config) -> bool:
    return architecture(hf_config) in ENCODER_TASKS


def supported_tasks(hf_config, runner: str = "auto") -> tuple[str, ...]:
    """The tasks the engine serves for this model under ``runner`` ("auto": an encoder pools, a
    decoder generates and embeds; "pooling": a decoder embeds only; "generate": a decoder only)."""
    check_runner(runner)
    arch = architecture(hf_config)
    if arch in ENCODER_TASKS:
        if runner == "generate":
            raise ConfigError(f"{arch} is an encoder: it cannot generate (use runner='pooling' or 'auto')")
        return ENCODER_TASKS[arch]
    if arch in DECODER_CLASSIFIERS:
        if runner == "generate":
            raise ConfigError(f"{arch} has a classification head, no LM head: it cannot generate "
                              "(use runner='pooling' or 'auto')")
        return ("classify", "embed")
    return ("embed",) if runner == "pooling" else ("generate", "embed")


def encoder_engine_config(config, info):
    """``config`` as an encoder's core runs it (``info``: its ModelInfo): whole prompts in one
    step, no prefix cache."""
    if not is_encoder(info.hf_config):
        return config
    offset = getattr(info.hf_config, "pad_token_id", 1) + 1 \
        if getattr(info.hf_config, "model_type", "") in ("roberta", "xlm-roberta") else 0
    if offset:  # RoBERTa's positions start after pad_token_id: max_position_embeddings - offset tokens fit
        info.max_model_len = min(info.max_model_len, info.hf_config.max_position_embeddings - offset)
    return dataclasses.replace(config, enable_chunked_prefill=False, enable_prefix_caching=False,
                               max_num_batched_tokens=max(config.max_num_batched_tokens, info.max_model_len))


def check_task(tasks: tuple[str, ...], task: str) -> None:
    """InvalidRequestError naming what the model serves when ``task`` is not among them."""
    if task not in tasks:
        what, why = {"generate": ("generate text", "it has no language-model head: ask it to embed or rerank"),
                     "embed": ("embed", "ask another model"),
                     "classify": ("rerank or classify", "a cross-encoder or a classification model is needed")}[task]
        raise InvalidRequestError(f"this model cannot {what}: it serves {', '.join(tasks)} ({why})")


def default_pooling(hf_config, path: str | None) -> str:
    """How ``embed`` pools when the caller names no pooling: what a sentence-transformers
    checkpoint's ``modules.json`` says, else [CLS] for an encoder and the last token for a decoder.
    A classification model pools as its head expects (``rerank`` uses this too): [CLS] for a
    BERT cross-encoder, the last token for a decoder classifier."""
    arch = architecture(hf_config)
    if arch in DECODER_CLASSIFIERS or (is_encoder(hf_config) and "classify" in ENCODER_TASKS[arch]):
        return "cls" if is_encoder(hf_config) else "last"
    if path is not None:
        from asyncengine.models.st_pooling import read_st_pooling  # lazy: reads files, only at start

        try:
            spec = read_st_pooling(path)
        except ModelLoadError:  # modules we do not run: generation is unaffected, embed pools by default
            spec = None
        if spec is not None:
            return spec.pooling
    return "cls" if is_encoder(hf_config) else "last"


def check_request(tasks: tuple[str, ...], params) -> None:
    """A request's task (generate, or its pooling spec's) among what the model serves."""
    spec = params.pooling
    check_task(tasks, "generate" if spec is None else spec.task)
