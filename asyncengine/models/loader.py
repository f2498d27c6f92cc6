"""Checkpoint loading: a local HF folder (safetensors, single or sharded) or a GGUF file, into one
of our model classes, in the engine's dtype and device. Every failure is a ModelLoadError that
names the path and the problem."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncengine.config import EngineConfig
from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.models.registry import resolve_architecture

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_config: object
    tokenizer: object | None
    eos_token_ids: list[int]
    max_model_len: int
    path: str
    # sampling settings the checkpoint recommends (generation_config.json; GGUF general.sampling.*)
    generation_config: dict | None = None


def resolve_path(name_or_path: str | None) -> str:
    if name_or_path is not None and os.path.exists(name_or_path):
        return str(name_or_path)
    try:
        from asyncengine.models.default_model import resolve_model_path
    except ImportError:  # pragma: no cover - the default-model module ships with the package
        resolve_model_path = None
    if resolve_model_path is not None:
        return resolve_model_path(name_or_path)
    raise ModelLoadError(f"model path {name_or_path!r} does not exist")


def _safetensors_weights(path: Path):
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in path.glob("*.safetensors"))
        if not found:
            raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json "
                                 f"(only safetensors checkpoints are supported)")
        files = found
    for f in files:
        fp = path / f
        if not fp.exists():
            raise ModelLoadError(f"{path}: shard {f} named in the index is missing")
        try:
            with safe_open(str(fp), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"{fp}: cannot read safetensors file ({e})") from None


def _generation_config(path: Path) -> dict | None:
    gc = path / "generation_config.json"
    try:
        data = json.loads(gc.read_text()) if gc.exists() else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _eos_ids(path: Path, hf_config) -> list[int]:
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


def _load_tokenizer(path: str, config: EngineConfig):
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


def _max_model_len(hf_config, config: EngineConfig) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 4096
    window = getattr(hf_config, "sliding_window", None)
    uses_window = getattr(hf_config, "use_sliding_window", True)
    if window and uses_window and window < limit:
        # sliding-window attention is not implemented: serve only lengths inside one window
        limit = window
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ConfigError(f"max_model_len={config.max_model_len} exceeds what the model supports ({limit})")
    return config.max_model_len


def load_model(config: EngineConfig) -> LoadedModel:
    """Load ``config.model``. What it is doing is logged at INFO on this module's logger (the CLI
    shows it as one status line on stderr)."""
    say = log.info
    path = resolve_path(config.model)
    gguf = None
    if path.endswith(".gguf"):
        from asyncengine.models.gguf_loader import open_gguf

        say(f"reading {os.path.basename(path)}")
        # straight into the runtime format: no transformers config or model, weights decoded lazily
        gguf = open_gguf(path, tokenizer=not config.skip_tokenizer_init)
        hf_config, tokenizer, eos = gguf.config, gguf.tokenizer, list(gguf.eos_token_ids)
        from asyncengine.engine.defaults import gguf_generation_config

        generation_config = gguf_generation_config(gguf.metadata)
        weights = None
    else:
        p = Path(path)
        if not p.is_dir():
            raise ModelLoadError(f"model path {path!r} is neither a checkpoint folder nor a .gguf file")
        if not (p / "config.json").exists():
            raise ModelLoadError(f"{path}: no config.json (is this a Hugging Face checkpoint folder?)")
        from transformers import AutoConfig
        try:
            hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read config.json ({e})") from None
        weights = None
        tokenizer = None
        eos = _eos_ids(p, hf_config)
        generation_config = _generation_config(p)
    cls = resolve_architecture(hf_config)
    max_len = _max_model_len(hf_config, config)
    with torch.device("meta"):
        model = cls(hf_config, max_positions=max_len)
    cache, cached = None, False
    # unsharded CPU loads only: a key without the shard would hand one rank another's weights
    if gguf is not None and config.torch_device.type == "cpu" and \
            (getattr(config, "tensor_parallel_size", None) or 1) == 1:
        from asyncengine.models import weight_cache

        if weight_cache.enabled_for(path):
            cache = weight_cache.cache_file(path, config.torch_dtype, cls)
            cached = weight_cache.load(model, cache)
    if not cached:
        model = model.to_empty(device=config.torch_device).to(config.torch_dtype)
    model.rotary.build(config.torch_device)
    if not cached:
        if gguf is not None:
            say(f"decoding {os.path.basename(path)} (once; later starts map a cached copy)" if cache
                else f"decoding {os.path.basename(path)}")
            weights = gguf.weights(config.torch_dtype)
        else:
            say(f"reading {path}")
            weights = _safetensors_weights(Path(path))
            tokenizer = _load_tokenizer(path, config)
        try:
            model.load_weights(weights)
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{path}: checkpoint does not match {cls.__name__}: {e}") from None
        if cache is not None:
            say("writing the weight cache")
            weight_cache.save(model, cache)
    model.eval()
    return LoadedModel(model=model, hf_config=hf_config, tokenizer=tokenizer, eos_token_ids=eos,
                       max_model_len=max_len, path=path, generation_config=generation_config)
