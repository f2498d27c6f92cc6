"""Multi-LoRA limits (docs/lora.md): checked here so that EngineConfig stays one screen of fields.

``max_loras`` adapters may share one step (device slots), ``max_cpu_loras`` stay loaded in host
memory (an LRU over them), and no adapter may have a rank above ``max_lora_rank``: the slots are
sized for it once, so that a new adapter never reallocates them mid-serving.
"""
from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from asyncengine.errors import ConfigError

# vLLM's accepted ranks are any positive int up to 512; larger ranks are not low-rank any more
MAX_SUPPORTED_RANK = 512


def check_lora_limits(enable_lora: bool, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None) -> None:
    """Raise ConfigError for limits that cannot serve (checked even with LoRA off: a typo is a typo)."""
    if max_loras < 1:
        raise ConfigError(f"max_loras must be >= 1, got {max_loras}")
    if not 1 <= max_lora_rank <= MAX_SUPPORTED_RANK:
        raise ConfigError(f"max_lora_rank must be in [1, {MAX_SUPPORTED_RANK}], got {max_lora_rank}")
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise ConfigError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras}): every "
                          "adapter in a device slot keeps its host copy")
    if not isinstance(enable_lora, bool):
        raise ConfigError(f"enable_lora must be a bool, got {enable_lora!r}")


def parse_lora_module(spec: str) -> tuple[str, str]:
    """``name=path`` (the --lora-modules flag, vLLM's spelling) -> (name, path)."""
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ConfigError(f"--lora-modules takes name=path, got {spec!r}")
    return name.strip(), path.strip()


def check_adapter_files(path: str, max_rank: int) -> dict:
    """The torch-free checks of a PEFT LoRA folder (the front end runs them before a request is
    queued): both files there, a LoRA config, a rank within ``max_rank``. Returns the config.
    The tensors' shapes are checked against the model where it lives (lora/peft_adapter.py)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"LoRA adapter {path!r}: no such folder")
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"LoRA adapter {path!r} has no adapter_config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"LoRA adapter {path!r}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ConfigError(f"LoRA adapter {path!r} is not a PEFT LoRA adapter")
    if not (folder / "adapter_model.safetensors").is_file():
        raise ConfigError(f"LoRA adapter {path!r} has no adapter_model.safetensors")
    rank = cfg.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise ConfigError(f"LoRA adapter {path!r} has rank {rank}; this engine takes 1..{max_rank} (max_lora_rank)")
    check_adapter_options(cfg, repr(path))
    return cfg


def check_adapter_options(cfg: dict, where: str) -> None:
    """What PEFT can save that this engine does not apply: refused, not silently ignored."""
    if cfg.get("use_dora"):
        raise ConfigError(f"LoRA adapter {where}: DoRA adapters are not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ConfigError(f"LoRA adapter {where}: per-module rank_pattern / alpha_pattern are not supported")
    if cfg.get("fan_in_fan_out"):
        raise ConfigError(f"LoRA adapter {where}: fan_in_fan_out (Conv1D bases) is not supported")
    if cfg.get("modules_to_save"):
        raise ConfigError(f"LoRA adapter {where}: modules_to_save (whole embedding / lm_head copies) is not "
                          f"supported; LoRA targets: {', '.join(TARGETS)}")


def adapter_fingerprint(path: str) -> str:
    """What names an adapter's weights beyond its request id, for the prefix cache's keys: the
    folder's real path and its weights file's size and modification time. Request ids are the
    app's numbering and restart with it, while the disk KV tier outlives the process: keyed by id
    alone, another adapter under a reused id would read this one's blocks after a restart. A file
    the front end cannot see (another host) is named by its path alone."""
    real = os.path.realpath(path)
    try:
        st = os.stat(os.path.join(real, "adapter_model.safetensors"))
    except OSError:
        return real
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


# PEFT's target modules on Llama-family decoders, the block each lives in, and its tensors' key
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
LORA_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


def model_shapes(hf_config) -> dict[tuple[int, str], tuple[int, int]]:
    """(in, out) of each LoRA target of a Llama-family HF config, per (layer, module)."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    hd = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    one = {"q_proj": (hidden, heads * hd), "k_proj": (hidden, kv * hd), "v_proj": (hidden, kv * hd),
           "o_proj": (heads * hd, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
           "down_proj": (inter, hidden)}
    return {(i, m): s for i in range(hf_config.num_hidden_layers) for m, s in one.items()}


# safetensors dtypes an adapter may hold: bytes per value, and the exponent bits that are all ones
# exactly for inf and NaN (read as unsigned integers of that width)
FLOAT_DTYPES = {"F32": (4, 0x7F800000), "F16": (2, 0x7C00), "BF16": (2, 0x7F80)}


def _read_header(path: str) -> tuple[dict, int]:
    """The safetensors header of an adapter's weights file and where its data starts."""
    file = Path(path) / "adapter_model.safetensors"
    try:
        with open(file, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n)) if n < 1 << 27 else None
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise ConfigError(f"LoRA adapter {path!r}: adapter_model.safetensors is unreadable")
    return header, 8 + n


def check_adapter_values(path: str) -> None:
    """Every tensor of the weights file whole (the file not cut short) and finite: read once per
    adapter version by the front end (numpy, no torch), so that a NaN or a truncated file is a 400
    here instead of a failed load inside the engine's step."""
    import numpy as np  # lazy: only adapter checks read tensors here

    header, start = _read_header(path)
    file = Path(path) / "adapter_model.safetensors"
    size = file.stat().st_size
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        width, exp = FLOAT_DTYPES.get(meta.get("dtype"), (0, 0))
        shape, offsets = meta.get("shape"), meta.get("data_offsets")
        if not width:
            raise ConfigError(f"LoRA adapter {path!r}: {key} is {meta.get('dtype')}, not F32, F16 or BF16")
        if (not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(v, int) and v >= 0 for v in [*shape, *offsets])):
            raise ConfigError(f"LoRA adapter {path!r}: {key} has a malformed header entry")
        count = 1
        for v in shape:
            count *= v
        a, b = offsets
        if b - a != count * width or start + b > size:
            raise ConfigError(f"LoRA adapter {path!r}: {key} lies past the end of adapter_model.safetensors "
                              f"(cut short?) or does not match its shape")
        if count:
            raw = np.memmap(file, dtype=np.uint32 if width == 4 else np.uint16, mode="r", offset=start + a,
                            shape=(count,))
            if np.any((raw & exp) == exp):
                raise ConfigError(f"LoRA adapter {path!r}: {key} holds NaN or infinite values")


def check_adapter_shapes(path: str, rank: int, shapes: dict[tuple[int, str], tuple[int, int]]) -> None:
    """The tensors' names and shapes from the safetensors header (no tensor is read, no torch):
    an adapter made for another base model is refused before it reaches a worker."""
    header, _ = _read_header(path)
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        m = LORA_KEY.search(key)
        if m is None or TARGETS.get(m.group(3)) != m.group(2):
            raise ConfigError(f"LoRA adapter {path!r}: tensor {key!r} targets no supported module ({', '.join(TARGETS)})")
        where = (int(m.group(1)), m.group(3))
        if where not in shapes:
            raise ConfigError(f"LoRA adapter {path!r}: the base model has no layer {where[0]} {where[1]}")
        fan_in, fan_out = shapes[where]
        want = [rank, fan_in] if m.group(4) == "A" else [fan_out, rank]
        if list(meta.get("shape", ())) != want:
            raise ConfigError(f"LoRA adapter {path!r}: {key} has shape {meta.get('shape')}, the base model needs "
                              f"{want} (an adapter for another base model?)")
