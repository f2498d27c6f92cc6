"""What the front end and the engine core know of a model before any weight is read: its config,
tokenizer, end-of-generation ids, recommended sampling settings and length limit.

No torch here: a GGUF's config and vocabulary come from its metadata (an HF folder's from
transformers' config and tokenizer classes, which may import torch themselves). A front end whose
engine core runs in another process reads this while the core imports torch."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from asyncengine.config.sub_configs import ModelConfig
from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.models.registry import check_architecture

log = logging.getLogger(__name__)


def resolve_path(name_or_path: str | None) -> str:
    if name_or_path is not None and os.path.exists(name_or_path):
        return str(name_or_path)
    try:
        from asyncengine.models.default_model import resolve_model_path  # lazy: only on this loading path
    except ImportError:  # pragma: no cover - the default-model module ships with the package
        resolve_model_path = None
    if resolve_model_path is not None:
        return resolve_model_path(name_or_path)
    raise ModelLoadError(f"model path {name_or_path!r} does not exist")


def read_generation_config(path: Path) -> dict | None:
    gc = path / "generation_config.json"
    try:
        data = json.loads(gc.read_text()) if gc.exists() else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_eos_ids(path: Path, hf_config) -> list[int]:
    ids = None
    gc = path / "generation_config.json"
    if gc.exists():
        try:
            ids = json.loads(gc.read_text()).get("eos_token_id")
        except ValueError:
            ids = None
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


def load_tokenizer(path: str, config: ModelConfig):
    if config.skip_tokenizer_init:
        return None
    tok_path = Path(config.tokenizer or path)
    if not any((tok_path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        if config.tokenizer:
            raise ModelLoadError(f"tokenizer {config.tokenizer!r} has no tokenizer files")
        log.warning("%s has no tokenizer files: serving token-id prompts only", path)
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(tok_path), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{tok_path}: cannot load tokenizer ({e})") from None


def resolve_max_model_len(hf_config, config: ModelConfig) -> int:
    # (sliding-window models serve their full length: their layers mask what left the window)
    limit = getattr(hf_config, "max_position_embeddings", None) or 4096
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ConfigError(f"max_model_len={config.max_model_len} exceeds what the model supports ({limit})")
    return config.max_model_len


@dataclass
class ModelInfo:
    """What the front end and the core need to know of a model without its weights (the weights
    live in the executor's workers)."""

    hf_config: object
    tokenizer: object | None
    eos_token_ids: list[int]
    max_model_len: int
    vocab_size: int
    path: str
    # sampling settings the checkpoint recommends (generation_config.json; GGUF general.sampling.*):
    # the front end's defaults (models/sampling_defaults.py)
    generation_config: dict | None = None


def load_model_info(config: ModelConfig) -> ModelInfo:
    """Config, tokenizer, generation config and limits of the model ``config`` (the model's view,
    ``EngineConfig.model_config``) names; reads no weight."""
    path = resolve_path(config.model)
    if path.endswith(".gguf"):
        if config.model_impl == "transformers":
            raise ConfigError(f"{path}: GGUF files load into our native models only (model_impl='transformers' "
                              "needs a safetensors checkpoint)")
        from asyncengine.models.sampling_defaults import gguf_generation_config  # lazy: GGUF reading only for a .gguf model
        from asyncengine.models.gguf import open_gguf  # lazy: GGUF reading only for a .gguf model

        log.info(f"reading {os.path.basename(path)}")
        # straight into the runtime format: no transformers config, the fast tokenizer where it applies
        gguf = open_gguf(path, tokenizer=not config.skip_tokenizer_init)
        hf_config, tokenizer, eos = gguf.config, gguf.tokenizer, list(gguf.eos_token_ids)
        generation_config = gguf_generation_config(gguf.metadata)
    else:
        hf_config = read_hf_config(path)
        tokenizer = load_tokenizer(path, config)
        eos = read_eos_ids(Path(path), hf_config)
        generation_config = read_generation_config(Path(path))
    check_architecture(hf_config, config.model_impl)  # fail here, before any worker starts, on an unknown model
    return ModelInfo(hf_config=hf_config, tokenizer=tokenizer, eos_token_ids=eos,
                     max_model_len=resolve_max_model_len(hf_config, config), vocab_size=hf_config.vocab_size, path=path,
                     generation_config=generation_config)


def read_hf_config(path: str):
    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(f"model path {path!r} is neither a checkpoint folder nor a .gguf file")
    if not (p / "config.json").exists():
        raise ModelLoadError(f"{path}: no config.json (is this a Hugging Face checkpoint folder?)")
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot read config.json ({e})") from None
    return text_part(config)


# multimodal checkpoints whose text model we serve alone: the config's text part stands for it
TEXT_PART_ARCHITECTURES = frozenset({"Gemma3ForConditionalGeneration"})


# vision-language checkpoints we serve with their images: the text part stands for the config (so
# every reader of the LM's sizes finds them), the vision facts ride along as a plain dict ``llava``
VISION_ARCHITECTURES = frozenset({"LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration",
                                  "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"})
_VISION_KEYS = ("image_token_index", "vision_feature_layer", "vision_feature_select_strategy",
                "projector_hidden_act", "multimodal_projector_bias", "scale_factor", "image_token_id",
                "vision_start_token_id", "vision_end_token_id")


_QWEN_VL = frozenset({"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"})


def text_part(config):
    """A multimodal config's ``text_config`` (still naming the multimodal architecture, so the
    registry picks the class that skips the vision weights, or runs them: ``llava``); any other
    config as it is."""
    archs = list(getattr(config, "architectures", None) or ())
    text = getattr(config, "text_config", None)
    if text is not None and VISION_ARCHITECTURES.intersection(archs):
        text.architectures = archs
        text.llava = {k: getattr(config, k) for k in _VISION_KEYS if hasattr(config, k)}
        text.llava["vision_config"] = config.vision_config.to_dict()
        text.llava["model_type"] = config.model_type  # which processor (multimodal/processor.py)
        if "Idefics3ForConditionalGeneration" in archs:  # its outer config ties the head or not
            text.llava["image_token_index"] = config.image_token_id
            text.tie_word_embeddings = bool(config.tie_word_embeddings)
        if _QWEN_VL.intersection(archs):  # the top level says (Qwen2-VL-2B ties the head; its text config cannot)
            text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        return text
    if text is None or not TEXT_PART_ARCHITECTURES.intersection(archs):
        return config
    text.architectures = archs
    return text
