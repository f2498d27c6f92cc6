"""The config fields of Gemma 2, Gemma 3 and Phi-3 GGUF files beyond Llama's keys (config.py).

What llama.cpp's converter writes, and what llama.cpp assumes where it writes nothing:

* Gemma: ``attention.sliding_window`` and optionally ``attention.sliding_window_pattern`` (a period
  or one bool per layer; without it every 2nd layer is global for Gemma 2, every 6th for Gemma 3),
  ``attn_logit_softcapping`` / ``final_logit_softcapping`` (Gemma 2's defaults 50 and 30),
  ``rope.freq_base_swa`` (Gemma 3's local rope base, 10000 when absent). ``query_pre_attn_scalar``
  is not written: llama.cpp takes ``head_dim``, or ``hidden / heads`` for the 27B models (known by
  their layer count), as Google's reference code does; so do we.
* Phi-3: ``rope.dimension_count`` (partial rotary), ``rope.scaling.original_context_length``,
  ``attention.sliding_window`` (0: none), and LongRoPE's factors as the tensors
  ``rope_factors_short`` / ``rope_factors_long``.
"""

from __future__ import annotations

import typing
from typing import Any, Callable

import numpy as np

from asyncengine.errors import ModelLoadError

if typing.TYPE_CHECKING:
    from asyncengine.models.gguf.reader import GGUFFile

__all__ = ["arch_kwargs"]

_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's test for the 27B attention scale
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}


def arch_kwargs(f: GGUFFile, gguf_arch: str, key: Callable[..., Any], kwargs: dict[str, Any], path: str) -> None:
    """Complete ``kwargs`` (Llama's fields, from config_kwargs) for ``gguf_arch``, in place."""
    if gguf_arch in _SWA_PERIOD:
        _gemma(gguf_arch, key, kwargs, path)
    elif gguf_arch == "phi3":
        _phi3(f, key, kwargs, path)


def _f32(value) -> float:
    """A float32 as the decimal it was written from (1.10000002 -> 1.1), as config.py reads metadata."""
    return float(str(np.float32(value)))


def _layer_types(gguf_arch: str, key, n_layers: int, path: str) -> list[str]:
    pattern = key("attention.sliding_window_pattern", _SWA_PERIOD[gguf_arch])
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ModelLoadError(f"{path}: sliding_window_pattern has {len(pattern)} entries for {n_layers} layers.")
        sliding = [bool(p) for p in pattern]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(n_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _gemma(gguf_arch: str, key, kwargs: dict[str, Any], path: str) -> None:
    n_layers, hidden, heads = kwargs["num_hidden_layers"], kwargs["hidden_size"], kwargs["num_attention_heads"]
    del kwargs["hidden_act"]
    kwargs["hidden_activation"] = "gelu_pytorch_tanh"
    big = n_layers == _GEMMA_27B_LAYERS[gguf_arch]
    kwargs["query_pre_attn_scalar"] = hidden // heads if big else kwargs["head_dim"]
    window = int(key("attention.sliding_window", 4096 if gguf_arch == "gemma2" else 0))
    if window > 0:
        kwargs.update(sliding_window=window, layer_types=_layer_types(gguf_arch, key, n_layers, path))
    else:
        kwargs.update(sliding_window=None, layer_types=["full_attention"] * n_layers)
    if gguf_arch == "gemma2":
        kwargs["attn_logit_softcapping"] = float(key("attn_logit_softcapping", 50.0)) or None
        kwargs["final_logit_softcapping"] = float(key("final_logit_softcapping", 30.0)) or None
        return
    kwargs["final_logit_softcapping"] = float(key("final_logit_softcapping", 0.0)) or None
    local = {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10000.0))}
    kwargs["rope_parameters"] = {"full_attention": kwargs["rope_parameters"], "sliding_attention": local}


def _phi3(f: GGUFFile, key, kwargs: dict[str, Any], path: str) -> None:
    head_dim = kwargs.pop("head_dim")  # Phi3Config derives it (hidden // heads)
    if head_dim != kwargs["hidden_size"] // kwargs["num_attention_heads"]:
        raise ModelLoadError(f"{path}: phi3 with head_dim {head_dim} != hidden/heads is not supported.")
    rope = dict(kwargs["rope_parameters"])
    rotary = int(key("rope.dimension_count", head_dim))
    if rotary != head_dim:
        rope["partial_rotary_factor"] = kwargs["partial_rotary_factor"] = rotary / head_dim
    original = key("rope.scaling.original_context_length", None)
    if original is not None:
        kwargs["original_max_position_embeddings"] = int(original)
    factors = {t.name: t for t in f.tensors if t.name in ("rope_factors_short.weight", "rope_factors_long.weight")}
    if factors:
        if len(factors) != 2 or original is None:
            raise ModelLoadError(f"{path}: LongRoPE needs both rope_factors_short and rope_factors_long and "
                                 "rope.scaling.original_context_length.")
        short, long = (f.floats(factors[f"rope_factors_{k}.weight"]).reshape(-1) for k in ("short", "long"))
        if len(short) != rotary // 2 or len(long) != rotary // 2:
            raise ModelLoadError(f"{path}: the LongRoPE factors have {len(short)}/{len(long)} entries, "
                                 f"expected {rotary // 2}.")
        rope.update(rope_type="longrope", original_max_position_embeddings=int(original),
                    short_factor=[_f32(x) for x in short], long_factor=[_f32(x) for x in long])
    elif key("rope.scaling.type", None) == "longrope":
        raise ModelLoadError(f"{path}: rope scaling 'longrope' without the rope_factors tensors.")
    kwargs["rope_parameters"] = rope
    kwargs["sliding_window"] = int(key("attention.sliding_window", 0)) or None
