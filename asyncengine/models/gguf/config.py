"""A GGUF file's model config: its metadata keys (``llama.block_count``...) under Hugging Face's names.

Two forms: :class:`GGUFModelConfig`, a plain object the engine's model classes read (building a
transformers config would import transformers' model configs: ~2.5 s of a one-line chat), and a
transformers ``PretrainedConfig`` (:func:`build_config`) for the Hugging Face view (``load_gguf``).

Llama 3.x rope scaling is not in the metadata: llama.cpp's converter turned it into a
``rope_freqs`` tensor of per-frequency divisors; we fit the ``llama3`` rope parameters back from it
(:func:`fix_rope_from_freqs`).
"""

from __future__ import annotations

import logging
import math
import typing
from typing import Any

import numpy as np

from asyncengine.errors import ModelLoadError
from asyncengine.models.gguf.arch_config import arch_kwargs
from asyncengine.models.gguf.moe import MOE_ARCHITECTURES, moe_kwargs

if typing.TYPE_CHECKING:
    import torch
    import transformers

    from asyncengine.models.gguf.reader import GGUFFile

logger = logging.getLogger(__name__)

__all__ = ["GGUFModelConfig", "SUPPORTED_ARCHITECTURES", "architecture", "build_config", "config_kwargs",
           "fix_rope_from_freqs"]

# GGUF `general.architecture` -> (transformers model_type, HF architecture name)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),  # also Mistral-style models, which llama.cpp writes as llama
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    **MOE_ARCHITECTURES,  # (and Mixtral: "llama" with an expert count; gguf/moe.py)
}


class GGUFModelConfig:
    """A model config straight from GGUF metadata, under Hugging Face's attribute names (what the
    model classes read), without building a transformers config (importing transformers' model
    configs cost ~2.5 s of a one-line chat)."""

    def __init__(self, model_type: str, **fields: Any) -> None:
        self.model_type = model_type
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"GGUFModelConfig({self.__dict__!r})"


def architecture(metadata: dict, path) -> str:
    """The file's ``general.architecture``, refused unless we support it."""
    gguf_arch = metadata.get("general.architecture")
    if gguf_arch is None:
        raise ModelLoadError(f"{path}: the GGUF metadata has no 'general.architecture' key.")
    if gguf_arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {gguf_arch!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}."
        )
    return gguf_arch


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def build_config(f: GGUFFile, gguf_arch: str, path: str) -> transformers.PretrainedConfig:
    """The metadata as a transformers config (for load_gguf's Hugging Face view)."""
    import transformers

    model_type, kwargs = config_kwargs(f, gguf_arch, path)
    config_cls = transformers.CONFIG_MAPPING[model_type]
    try:
        config = config_cls(**kwargs)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"{path}: the GGUF metadata does not make a valid {config_cls.__name__}: {exc}") from None
    config._name_or_path = path  # as from_pretrained records where a model came from
    return config


def _rope_parameters(key, path: str) -> dict[str, Any]:
    """The rope base and its linear or yarn scaling (Llama 3's: fix_rope_from_freqs; Phi-3's
    LongRoPE: arch_config.py)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(key("rope.freq_base", 10000.0))}
    scaling = key("rope.scaling.type", None)
    if scaling not in (None, "none", "longrope"):  # (longrope: Phi-3's, arch_config.py)
        factor = _f32(key("rope.scaling.factor", 1.0))
        original = key("rope.scaling.original_context_length", None)
        if scaling == "linear":
            rope.update(rope_type="linear", factor=factor)
        elif scaling == "yarn":
            rope.update(rope_type="yarn", factor=factor)
            if original is not None:
                rope["original_max_position_embeddings"] = int(original)
        else:
            raise ModelLoadError(f"{path}: rope scaling type {scaling!r} is not supported (linear and yarn are).")
    return rope


def config_kwargs(f: GGUFFile, gguf_arch: str, path: str) -> tuple[str, dict[str, Any]]:
    """(model_type, the config's fields under their Hugging Face names) from the metadata."""
    model_type, hf_arch = SUPPORTED_ARCHITECTURES[gguf_arch]
    md = f.metadata
    names = {t.name: t for t in f.tensors}

    def key(name: str, default: Any = KeyError):
        full = f"{gguf_arch}.{name}"
        if full in md:
            return md[full]
        if default is KeyError:
            raise ModelLoadError(f"{path}: required metadata key {full!r} is missing.")
        return default

    hidden = int(key("embedding_length"))
    n_head = int(key("attention.head_count"))
    n_kv = key("attention.head_count_kv", n_head)
    if isinstance(n_kv, list):  # per-layer counts (some hybrid models); a plain transformer has one value
        if len(set(n_kv)) != 1:
            raise ModelLoadError(f"{path}: per-layer KV head counts {n_kv} are not supported.")
        n_kv = n_kv[0]
    n_kv = int(n_kv)

    embd = names.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"{path}: the file has no 'token_embd.weight' tensor.")
    vocab_size = int(embd.shape[0])  # (vocab, hidden)

    head_dim = key("attention.key_length", None)
    if head_dim is None:
        q = names.get("blk.0.attn_q.weight")
        head_dim = int(q.shape[0]) // n_head if q is not None else hidden // n_head
    head_dim = int(head_dim)

    rope = _rope_parameters(key, path)

    def token_id(name: str) -> int | None:
        value = md.get(f"tokenizer.ggml.{name}")
        return int(value) if value is not None else None

    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length", 4096)),
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("padding_token_id"),
        hidden_act="silu",
    )
    if model_type == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in names
    elif model_type == "qwen2":
        del kwargs["head_dim"]  # Qwen2Config derives it (hidden // heads), it takes no argument
        if head_dim != hidden // n_head:
            raise ModelLoadError(f"{path}: qwen2 with head_dim {head_dim} != hidden/heads is not supported.")
    elif model_type == "qwen3":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    arch_kwargs(f, gguf_arch, key, kwargs, path)  # Gemma 2/3, Phi-3
    if gguf_arch == "llama" or gguf_arch in MOE_ARCHITECTURES:
        model_type, _ = moe_kwargs(gguf_arch, model_type, key, kwargs, path)
    return model_type, kwargs


# ----------------------------------------------------------------------------------- llama3 rope


def _llama3_rope_from_freqs(freqs: np.ndarray, theta: float, head_dim: int, original_ctx: int):
    """Recover ``llama3`` rope parameters from llama.cpp's ``rope_freqs`` divisors, or None.

    llama.cpp stores, per frequency ``i``, the divisor it applies: 1 (high frequency), ``factor``
    (low frequency) or ``1 / ((1 - s) / factor + s)`` in between, with
    ``s = (original_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    ``s`` is affine in ``1 / wavelen``; fitting that line gives the two frequency factors for the
    chosen ``original_ctx`` (any choice reproduces the same divisors).
    """
    freqs = np.asarray(freqs, dtype=np.float64)
    factor = float(freqs.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(inv_freq) != len(freqs):
        return None
    wavelen = 2 * math.pi / inv_freq
    inner = (freqs > 1.0 + 1e-4) & (freqs < factor - 1e-4 * factor)
    if inner.sum() < 2:
        return None
    s = (1.0 / freqs[inner] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(1.0 / wavelen[inner], s, 1)  # s = slope / wavelen + intercept
    if slope <= 0:
        return None
    span = original_ctx / slope  # high_freq_factor - low_freq_factor
    low = -intercept * span
    params = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(low + span),
        "original_max_position_embeddings": int(original_ctx),
    }
    # The fit is exact up to float noise: prefer the round numbers configs use (1.0, 4.0) when they fit.
    rounded = dict(params, low_freq_factor=round(params["low_freq_factor"], 4),
                   high_freq_factor=round(params["high_freq_factor"], 4))
    if np.allclose(_llama3_divisors(rounded, wavelen), freqs, rtol=1e-4, atol=1e-4):
        params = rounded
    if not np.allclose(_llama3_divisors(params, wavelen), freqs, rtol=1e-3, atol=1e-3):
        return None
    return params


def _llama3_divisors(params: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """The per-frequency divisors llama.cpp derives from llama3 rope parameters."""
    factor, original_ctx = params["factor"], params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    low_wl, high_wl = original_ctx / low, original_ctx / high
    smooth = (original_ctx / wavelen - low) / (high - low)
    with np.errstate(divide="ignore", invalid="ignore"):
        middle = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor, middle))


def fix_rope_from_freqs(config, extra: dict[str, np.ndarray | torch.Tensor], path: str) -> None:
    """Set ``config.rope_parameters`` to llama3 scaling when the file has a ``rope_freqs`` tensor
    (``extra``, under its GGUF name: an array or a tensor) and the metadata names no other scaling."""
    freqs = extra.get("rope_freqs")
    if freqs is None:
        return
    rope = dict(config.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        return  # the metadata already said how the rope is scaled
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    original_ctx = 8192  # Llama 3's; any value fits, see _llama3_rope_from_freqs
    freqs = freqs.float().numpy() if hasattr(freqs, "float") else np.asarray(freqs, dtype=np.float32)
    params = _llama3_rope_from_freqs(freqs, rope.get("rope_theta", 10000.0), head_dim, original_ctx)
    if params is None:
        logger.warning(
            "%s: has a rope_freqs tensor that is not Llama 3 rope scaling; it is left in extra_tensors "
            "and the model will use unscaled rope.", path,
        )
        return
    config.rope_parameters = params
