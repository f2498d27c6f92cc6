"""What runs the model, in one line for the CLI's ready line and the logs: the dtype and why,
the quantized kernels' activations and instruction set, the attention backend."""
from __future__ import annotations

from asyncengine.config.sub_configs import ModelConfig


def describe(config: ModelConfig, via_transformers: bool = False, attention: str | None = None) -> str:
    """E.g. "float32 (auto: block-quantized weights run fp32/int8 kernels); int8 activations x
    quantized weights on avx512_vnni; cpu attention". ``via_transformers``: the model runs through
    the Transformers backend (models/transformers_backend.py), which the line says: it is slower
    than a native model (transformers' per-op code, no native decode step). ``attention``: the
    backend the workers built (auto can fall back for a model); the config's resolution otherwise."""
    dtype = str(config.torch_dtype).removeprefix("torch.")
    parts = [f"{dtype} ({config.dtype_reason})"]
    if config.torch_device.type == "cpu" and config.block_quantized_weights:
        from asyncengine.kernels.cpu import quant  # lazy: the kernels build/load (C compile, triton) only on this path

        isa = quant.isa()
        if isa is None:
            parts.append("quantized weights on the torch fallback (the C kernels did not build)")
        else:
            mode = quant.ACTIVATIONS if config.quantized_activations == "auto" else config.quantized_activations
            # the fp32 kernel's SIMD is fixed at build time (-march=native); the int8 one's at run time
            parts.append(f"int8 activations x quantized weights on {isa}" if mode == "int8"
                         else "fp32 activations x quantized weights")
    parts.append(f"{attention or config.attention_backend_name} attention")
    if via_transformers:
        parts.append("model code from transformers (Transformers backend; no native decode step)")
    return "; ".join(parts)
