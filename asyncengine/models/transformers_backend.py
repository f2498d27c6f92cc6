"""The Transformers backend: any decoder-only ``*ForCausalLM`` that transformers ships, run on our
engine (continuous batching, chunked prefill, prefix caching, streaming, structured outputs).

transformers builds the model (its embeddings, norms, MLPs and rotary embedding, in its own code),
and every attention layer calls OUR paged attention: transformers routes attention through its
``AttentionInterface``, which we register as ``"asyncengine"``. The model runs on the step's flat
batch as one sequence of ``T`` tokens (``position_ids`` carry each request's real positions), and
the attention function hands q/k/v to the engine's attention backend, which writes K/V into the
paged cache and attends per request. No mask is built: the backend knows the request boundaries.

Why not a native port for every model: the long tail of architectures then runs without new code
(vLLM's ``model_executor/models/transformers``). Slower than a native model (no fused projections,
no native decode step), so a model we implement natively is preferred (``model_impl="auto"``).

What it cannot run is refused at load with the reason (:func:`check_supported`): encoder-decoder
models, models whose attention bypasses the interface, remote code, tensor or pipeline parallel.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

from asyncengine.errors import ConfigError
from asyncengine.layers.parallel import FULL, SINGLE, PPGroup, TPGroup

IMPL_NAME = "asyncengine"
_step = threading.local()  # this thread's step: (kv_caches, meta); set around each forward


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sliding_window=None, **kwargs):
    """transformers' attention signature: query [1, Hq, T, D], key/value [1, Hkv, T, D] (rotary
    applied). Returns ([1, T, Hq, D], None), what its eager attention returns."""
    kv_caches, meta = _step.current
    backend = meta.backend
    t = query.shape[2]
    q = query[0].transpose(0, 1)
    if scaling is not None and scaling != backend.scale:  # the backend's scale is head_dim ** -0.5
        q = q * (scaling / backend.scale)
    k, v = key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous()
    window = sliding_window or getattr(module, "sliding_window", None)
    out = backend.forward(q.contiguous(), k, v, kv_caches[module.layer_idx], meta, window)
    return out.view(1, t, query.shape[1], query.shape[3]), None


def _no_mask(*args, **kwargs):
    """The paged backend masks by request itself: transformers builds no mask."""
    return None


def register() -> None:
    """Make ``attn_implementation="asyncengine"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPL_NAME, _paged_attention)
    AttentionMaskInterface.register(IMPL_NAME, _no_mask)


def as_transformers_config(hf_config):
    """A ``PretrainedConfig``: the worker may get the config as a plain namespace (from a dict)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(hf_config, PretrainedConfig):
        return hf_config
    d = {k: v for k, v in vars(hf_config).items() if not k.startswith("_")}
    return AutoConfig.for_model(d.pop("model_type"), **d)


def model_class(hf_config):
    """The transformers class for the config's first architecture that transformers ships."""
    import transformers

    for arch in list(getattr(hf_config, "architectures", None) or []):
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    if getattr(hf_config, "auto_map", None):
        raise ConfigError(f"model architecture {hf_config.architectures} is remote code (auto_map), which the "
                          "Transformers backend does not run")
    raise ConfigError(f"model architecture {getattr(hf_config, 'architectures', None)} is neither one of ours "
                      f"nor a class transformers {transformers.__version__} ships")


def check_supported(hf_config, tp_size: int = 1, pp_size: int = 1) -> None:
    """ConfigError with the reason for a model the Transformers backend cannot run."""
    cls = model_class(hf_config)
    arch = cls.__name__
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ConfigError(f"{arch} is an encoder-decoder model: the engine runs decoder-only models")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal_lms

    if arch not in set(causal_lms.values()):
        raise ConfigError(f"{arch} is not one of transformers' causal language models (AutoModelForCausalLM)")
    if not getattr(cls, "_supports_attention_backend", False):
        raise ConfigError(f"{arch}'s attention bypasses transformers' attention interface "
                          "(_supports_attention_backend is False): the Transformers backend cannot page its KV")
    if tp_size > 1:
        from asyncengine.models.transformers_tp import tp_plan  # lazy: only tensor parallel needs it

        tp_plan(hf_config, tp_size)
    if pp_size > 1:
        raise ConfigError(f"{arch} through the Transformers backend: pipeline_parallel_size > 1 is not supported")


@dataclass
class BackendArgs:
    """What the runner reads of a model (``model.args``), taken from the transformers config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    tie_word_embeddings: bool
    layer_windows: tuple[int | None, ...]

    @classmethod
    def from_hf(cls, cfg, max_positions: int) -> "BackendArgs":
        heads = cfg.num_attention_heads
        n = cfg.num_hidden_layers
        window = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None)
        if window and types:
            windows = tuple(window if t == "sliding_attention" else None for t in types)
        else:
            windows = (window or None,) * n
        return cls(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=n, num_heads=heads,
                   num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   max_positions=max_positions,
                   tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), layer_windows=windows)


class _Rotary:
    """The loader's ``model.rotary.build(device)`` hook: the rotary tables are non-persistent
    buffers, left uninitialised by building on the meta device; recompute them on ``device``."""

    def __init__(self, owner: "TransformersForCausalLM") -> None:
        self.owner = owner

    def build(self, device: torch.device) -> None:
        for module in self.owner.hf.modules():
            if "inv_freq" in module._buffers:
                with torch.device("cpu"):
                    fresh = type(module)(module.config)
                for name, buf in fresh.named_buffers(recurse=False):
                    module._buffers[name] = buf.to(device)
                if hasattr(fresh, "attention_scaling"):
                    module.attention_scaling = fresh.attention_scaling


class TransformersForCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` behind our model interface (``forward`` on a flat step,
    ``compute_logits``, ``load_weights``, ``args``/``num_heads``/``num_kv_heads``/``layers``)."""

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE, pp: PPGroup = FULL) -> None:
        super().__init__()
        cfg = as_transformers_config(hf_config)
        check_supported(cfg, tp.size, pp.size)
        register()
        self.tp, self.pp = tp, pp
        self.args = BackendArgs.from_hf(cfg, max_positions)
        cfg._attn_implementation = IMPL_NAME
        self.hf = model_class(cfg)(cfg)
        self.decoder = self.hf.base_model
        self.plan = {}
        if tp.size > 1:  # the model's own base_model_tp_plan (models/transformers_tp.py)
            from asyncengine.models import transformers_tp  # lazy: only tensor parallel needs it

            self.plan = transformers_tp.tp_plan(cfg, tp.size)
            transformers_tp.shard_modules(self.decoder, self.plan, tp)
            self.args.num_heads //= tp.size
            self.args.num_kv_heads //= tp.size
        self._rename = _renamer(self.hf)
        self._shapes = {n: tuple(p.shape) for n, p in self.hf.named_parameters(remove_duplicate=False)}
        self.rotary = _Rotary(self)
        self._check_layers()

    def _check_layers(self) -> None:
        attn = [m for m in self.hf.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
        if len({m.layer_idx for m in attn}) != self.args.num_layers:
            raise ConfigError(f"{type(self.hf).__name__}: found {len(attn)} attention modules with a layer index "
                              f"for {self.args.num_layers} layers: the Transformers backend cannot map its KV cache")

    @classmethod
    def check_tensor_parallel(cls, hf_config, size: int) -> None:
        check_supported(hf_config, size)

    @property
    def layers(self) -> list:
        """One entry per attention layer (the KV cache's layer count)."""
        return [None] * self.args.num_layers

    @property
    def num_heads(self) -> int:
        return self.args.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.args.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.args.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta, intermediate=None):
        """The step's final hidden states [T, hidden] (after the final norm)."""
        _step.current = (kv_caches, meta)
        try:
            out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            _step.current = None
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.tp.rank > 0:
            return None  # a replicated head: rank 0 computes every logit alone
        logits = self.hf.get_output_embeddings()(hidden)
        scale = getattr(self.hf.config, "logits_scaling", None)  # Granite divides its logits
        return logits / scale if scale else logits

    def weight_shard(self, name: str):
        """The slice of checkpoint tensor ``name`` this rank reads (tensor parallel), or None."""
        if not self.plan:
            return None
        from asyncengine.models.transformers_tp import weight_shard  # lazy: only tensor parallel needs it

        name = self._rename(name)
        shape = self._shapes.get(name)
        return None if shape is None else weight_shard(self.plan, self.tp, name, shape)

    def load_weights(self, weights) -> None:
        """(HF name, tensor) pairs, named as transformers saves this model; a tied head is the
        embedding. Anything missing or unexpected is an error (a wrong checkpoint fails loudly)."""
        params = dict(self.hf.named_parameters(remove_duplicate=False))
        loaded = set()
        rename = self._rename
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = rename(name)
            p = params.get(name)
            if p is None:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self.hf).__name__}")
            if p.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor)
            loaded.add(name)
        head, embed = self.hf.get_output_embeddings(), self.hf.get_input_embeddings()
        if self.args.tie_word_embeddings and head is not None:
            head.weight = embed.weight
            loaded |= {f"{n}.weight" for n, m in self.hf.named_modules() if m is head}
        missing = sorted(set(params) - loaded)
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _renamer(hf_model):
    """Checkpoint name -> the model's parameter name: transformers renames some legacy checkpoint
    keys at load (GPT-NeoX's ``embed_out`` is ``lm_head``); its conversions that also reshape or
    merge tensors (MoE expert stacking) are refused."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    transforms = get_model_conversion_mapping(hf_model)

    def rename(name: str) -> str:
        for t in transforms:
            new, matched = t.rename_source_key(name)
            if matched is None:
                continue
            if not isinstance(t, WeightRenaming):
                raise ValueError(f"{name}: transformers converts this tensor at load ({type(t).__name__}), "
                                 "which the Transformers backend does not do")
            name = new
        return name

    return rename
