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

from asyncengine.config.sub_configs import ModelConfig
from asyncengine.errors import ModelLoadError
from asyncengine.layers.linear import BLOCK_FORMATS, VocabEmbedding
from asyncengine.layers.parallel import SINGLE
from asyncengine.models.model_info import (load_tokenizer, read_eos_ids, read_generation_config, read_hf_config,
                                           resolve_max_model_len, resolve_path)
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


def _read_slice(get_slice, name: str, shard_of):
    """The tensor, or only this rank's slice of it (``shard_of(name) -> (dim, start, stop)``)."""
    spec = shard_of(name) if shard_of is not None else None
    sl = get_slice(name)
    if spec is None:
        return sl[:]
    dim, start, stop = spec
    index = tuple([slice(None)] * dim + [slice(start, stop)])
    return sl[index]


def _safetensors_weights(path: Path, shard_of=None):
    """(name, tensor) pairs; with ``shard_of``, each tensor is only this rank's slice, read with
    safetensors' ``get_slice`` (the rest of the file is never copied into memory)."""
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
                    if shard_of is None:
                        yield name, st.get_tensor(name)
                    else:
                        yield name, _read_slice(st.get_slice, name, shard_of)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"{fp}: cannot read safetensors file ({e})") from None


def load_model(config: ModelConfig, tp=None, tokenizer: bool = True, hf_config: dict | None = None,
               pp=None, read_weights: bool = True) -> LoadedModel:
    """Build the model of ``config`` (the model's view, ``EngineConfig.model_config``) and load its
    weights. With a ``TPGroup`` of size N (``tp``), build this
    rank's shard and read only its slices of the checkpoint. ``tokenizer=False``: a worker, which
    never needs one. ``hf_config``: the model config as a dict, already read by the engine (a
    worker process then never imports transformers for a safetensors checkpoint: seconds saved).
    ``pp``: a ``PPGroup``: build only this pipeline stage's layers (and skip the others' tensors).

    An unsharded GGUF goes straight into the runtime format (config from its metadata, weights
    decoded lazily, on CPU a memory-mapped weight cache for later starts: models/weight_cache.py);
    a shard reads only its slices (load_gguf(shard_of=...)). What it is doing is logged at INFO on
    this module's logger (the CLI shows it as one status line on stderr). ``read_weights=False``:
    the model's storage only, uninitialised (a full update_weights fills it: worker/sleep_mode.py)."""

    say = log.info
    tp = tp or SINGLE
    stage = {"pp": pp} if pp is not None and pp.size > 1 else {}  # models without stages never see it
    path = resolve_path(config.model)
    want_tok = tokenizer and not config.skip_tokenizer_init
    gguf, weights, tok, generation_config, file_types = None, None, None, None, None
    if path.endswith(".gguf"):
        from asyncengine.models.sampling_defaults import gguf_generation_config  # lazy: GGUF reading only for a .gguf model

        if tp.size > 1:
            from asyncengine.models.gguf import gguf_config, load_gguf  # lazy: GGUF reading only for a .gguf model

            from asyncengine.models.gguf import tensor_types  # lazy: GGUF reading only for a .gguf model

            hf_config = gguf_config(path)
            cls = resolve_architecture(hf_config, config.model_impl)
            max_len = resolve_max_model_len(hf_config, config)
            with torch.device("meta"):
                shape_model = cls(hf_config, max_positions=max_len, tp=tp, **stage)
            file_types = tensor_types(path)
            keep = choose_weight_storage(shape_model, config, file_types, quiet=True)
            say(f"reading rank {tp.rank}'s shard of {os.path.basename(path)}")
            ckpt = load_gguf(path, tokenizer=want_tok, shard_of=shape_model.weight_shard, keep_quantized=keep)
            hf_config, weights = ckpt.config, ckpt.tensors.items()
            tok, eos = ckpt.tokenizer, list(ckpt.eos_token_ids)
            generation_config = gguf_generation_config(ckpt.metadata)
        else:
            from asyncengine.models.gguf import open_gguf  # lazy: GGUF reading only for a .gguf model

            say(f"reading {os.path.basename(path)}")
            gguf = open_gguf(path, tokenizer=want_tok)
            hf_config, tok, eos = gguf.config, gguf.tokenizer, list(gguf.eos_token_ids)
            file_types = gguf.tensor_types
            generation_config = gguf_generation_config(gguf.metadata)
    else:
        if hf_config is not None:
            import types

            hf_config = types.SimpleNamespace(**hf_config)
        else:
            hf_config = read_hf_config(path)
        eos = read_eos_ids(Path(path), hf_config)
        generation_config = read_generation_config(Path(path))
    cls = resolve_architecture(hf_config, config.model_impl)
    max_len = resolve_max_model_len(hf_config, config)
    with torch.device("meta"):
        model = cls(hf_config, max_positions=max_len, tp=tp, **stage)
    keep = choose_weight_storage(model, config, file_types)
    cache, cached = None, False
    # unsharded CPU loads only: a key without the shard would hand one rank another's weights
    if gguf is not None and config.torch_device.type == "cpu" and tp.size == 1 and not stage and read_weights:
        from asyncengine.models import weight_cache  # lazy: only on this loading path

        if weight_cache.enabled_for(path):
            storage = sorted((name, m.qtype or "dense") for name, (m, _) in
                             getattr(model, "checkpoint_layers", dict)().items())
            cache = weight_cache.cache_file(path, config.torch_dtype, cls, variant=json.dumps(storage))
            cached = weight_cache.load(model, cache)
    materialize(model, config.torch_device, config.torch_dtype)  # all of it, or what the cache left
    for rope in _ropes(model):  # models without rope (Mamba2, NemotronH) have none; Gemma has two
        rope.build(config.torch_device)
    if not cached and read_weights:
        if gguf is not None:
            say(f"decoding {os.path.basename(path)} (once; later starts map a cached copy)" if cache
                else f"decoding {os.path.basename(path)}")
            weights = gguf.weights(config.torch_dtype, keep_quantized=keep)
        elif weights is None:
            say(f"reading {path}")
            weights = _safetensors_weights(Path(path), model.weight_shard if tp.size > 1 else None)
            tok = load_tokenizer(path, config) if tokenizer else None
        try:
            model.load_weights(weights)
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{path}: checkpoint does not match {cls.__name__}: {e}") from None
        if cache is not None:
            say("writing the weight cache")
            weight_cache.save(model, cache, source=path)
    model.eval()
    return LoadedModel(model=model, hf_config=hf_config, tokenizer=tok, eos_token_ids=eos,
                       max_model_len=max_len, path=path, generation_config=generation_config)


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give a meta-device model real, uninitialised storage on ``device``: floating tensors in
    ``dtype``, the others (quantized blocks) in their own. What ``model.to_empty(device).to(dtype)``
    does, without its detour: ``empty_like`` on a meta tensor runs torch's Python reference
    implementation, whose first call imports sympy (0.65 s of a one-line chat's start)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "meta":
                    continue
                new = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
                table[name] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new


def choose_weight_storage(model: torch.nn.Module, config: ModelConfig, file_types: dict[str, str] | None,
                          quiet: bool = False) -> frozenset[str]:
    """Pick every linear layer's storage (dense or a GGUF block format) on the not yet allocated
    model, per ``config.quantization`` (docs/quantization.md), and return the checkpoint names the
    loader should hand over as blocks. ``file_types``: a GGUF's HF name -> type name (None for
    safetensors).

    A layer keeps the file's block format when every checkpoint tensor fused into it has that same
    format (Q4_0, Q4_1 or Q8_0); "int8"/"int4" quantize the dense ones (F32/F16/BF16 or
    safetensors) into Q8_0 / Q4_1 (embedding and LM head: Q8_0 for both, as llama.cpp keeps its
    output layer at 8 bits). Dense stays dense on CUDA, with quantization="none", where a layer's
    input features do not fill whole blocks of 32 (say, a tensor-parallel slice of K), and where the
    C kernels are unavailable (no compiler, ASYNCENGINE_CPU_KERNELS=0): dequantizing once at load
    keeps today's speed, where dequantizing per call would cost every step a full decode of the
    weights."""

    mode = config.quantization
    if mode == "none" or config.torch_device.type != "cpu" or not hasattr(model, "checkpoint_layers"):
        return frozenset()
    if file_types is None and mode is None:
        return frozenset()  # a dense checkpoint in its own format
    types = {k.removeprefix("model."): v for k, v in (file_types or {}).items()}
    plan = {}
    from_values: set[str] = set()  # layers quantized from their dequantized values (no part kept as blocks)
    for name, (layer, ckpt) in model.checkpoint_layers().items():
        found = {"Q8_0" if types.get(n) == "Q5_0" else types.get(n) for n in ckpt}  # Q5_0: Q8_0 exactly
        qtype = None
        if len(found) == 1 and next(iter(found)) in BLOCK_FORMATS:
            qtype = next(iter(found))
        elif len(found) > 1 and found <= set(BLOCK_FORMATS) and mode is None:
            # parts in different formats (a Q4_K_M file's Q4_K q/k with a Q6_K v): one layer holds
            # one format, so the parts are re-quantized to Q8_0 at load (8.5 bits, near-lossless
            # against 4-6 bit parts) and the layer stays on the native kernels
            qtype = "Q8_0"
        elif mode is None and "Q5_1" in found and found <= set(BLOCK_FORMATS) | {"Q5_1"}:
            # Q5_1 (as Q5_0, which arrives as Q8_0 exactly: gguf/types.py KEPT_AS_BLOCKS): a
            # fallback of llama-quantize's for rows that are not whole 256-value super-blocks. No
            # kernel of ours reads it; 8-bit blocks quantized from its values keep the layer on the
            # quantized kernels (8.5 bits, not the 32 of a dequantized copy), as int8 mode does
            qtype = "Q8_0"
            from_values.add(name)
        elif mode in ("int8", "int4") and found <= {None, "F32", "F16", "BF16"}:
            qtype = "Q8_0" if mode == "int8" or isinstance(layer, VocabEmbedding) else "Q4_1"
        if qtype is not None and not layer.can_quantize(qtype):
            if not quiet:
                log.info("%s stays dense: its %d input features are not whole %s blocks", name,
                         layer.in_features, qtype)
            qtype = None
        if qtype is not None:
            plan[name] = (layer, ckpt, qtype)
    if not plan:
        return frozenset()
    from asyncengine.kernels.cpu import build_error, quant  # lazy: the kernels build/load (C compile, triton) only on this path

    if not quant.kernels_available():
        if not quiet:
            log.warning("the CPU kernels for quantized weights are unavailable (%s): dequantizing the weights "
                        "at load instead (same results, more memory)", build_error())
        return frozenset()
    keep = set()
    for name, (layer, ckpt, qtype) in plan.items():
        layer.quantize_as(qtype)
        if name in from_values:
            continue
        keep.update(f"model.{n}" if not n.startswith("lm_head.") else n for n in ckpt
                    if types.get(n) == qtype or types.get(n) in BLOCK_FORMATS or types.get(n) == "Q5_0")
    if not quiet:
        counts: dict[str, int] = {}
        for _, _, q in plan.values():
            counts[q] = counts.get(q, 0) + 1
        dense = len(model.checkpoint_layers()) - len(plan)
        log.info("weights: %s", ", ".join([f"{n} layers in {q}" for q, n in sorted(counts.items())]
                                          + ([f"{dense} dense"] if dense else [])))
    return frozenset(keep)


def _ropes(model) -> list:
    """The model's rotary tables (each once): ``model.rotary``, and Gemma's per-layer-kind ``model.ropes``."""
    out = list(getattr(model, "ropes", None) or ())
    rotary = getattr(model, "rotary", None)
    if rotary is not None and all(rotary is not r for r in out):
        out.append(rotary)
    return out
