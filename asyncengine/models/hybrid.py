"""What every hybrid (attention + Mamba2) decoder shares: the attention layer, the per-step context
the layers read their caches from, the embedding / final norm / LM head, and weight loading.

The concrete models (``mamba2.py``, ``bamba.py``, ``nemotron_h.py``) only say how one decoder
layer is wired and which HF names map to ours. Each attention layer reads its paged KV cache
(``kv_caches[kv_index]``, allocated by the runner's attention backend for the attention layers
only); each Mamba layer reads its state slots (``ssm.states[state_index]``, allocated by the
runner's :class:`~asyncengine.worker.state_cache.StateCache`).

Tensor parallelism is refused (:meth:`HybridForCausalLM.check_tensor_parallel`): splitting a
Mamba2 mixer's heads needs the in_proj split by [z | x | B | C | dt] parts and its groups kept
whole per rank, not built yet.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.layers.linear import Linear, VocabEmbedding
from asyncengine.layers.mamba2 import Mamba2Shape, SSMStepMeta
from asyncengine.layers.parallel import SINGLE, TPGroup
from asyncengine.layers.rotary import RotaryEmbedding
from asyncengine.models.layer_kinds import layer_kinds
from asyncengine.models.weight_loading import check_complete, load_tensor


@dataclass
class HybridArgs:
    """The fields the runner and the KV sizing read (the same names as ``LlamaArgs``)."""

    vocab_size: int
    hidden_size: int
    num_layers: int  # layers with a paged KV cache (the attention layers): what the backend allocates
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    tie_word_embeddings: bool
    layer_windows: tuple[None, ...] = ()  # one per attention layer: no sliding windows


@dataclass
class HybridStep:
    """One forward's caches and metadata, handed to every layer."""

    rope: tuple[torch.Tensor, torch.Tensor] | None  # (cos, signed sin) rows; None without rope
    kv_caches: list
    attn_meta: object
    ssm: SSMStepMeta


class HybridAttention(nn.Module):
    """Grouped-query attention over the paged cache; rope on the first ``rotary_dim`` channels of each
    head (Bamba rotates half of them; NemotronH none). ``scale``: the softmax scale when it is not
    1/sqrt(head_dim) (Granite's ``attention_multiplier``), applied by scaling q."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 rotary_dim: int, scale: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias,
                               parts=(self.q_size, self.kv_size, self.kv_size))
        self.o_proj = Linear(self.q_size, hidden, bias=bias)
        self.rotary_dim = rotary_dim
        self.q_scale = None if scale is None else scale * head_dim ** 0.5

    def forward(self, x: torch.Tensor, step: HybridStep, kv_cache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.reshape(t, self.num_heads, -1), k.reshape(t, self.num_kv_heads, -1), v.reshape(t, self.num_kv_heads, -1)
        if self.rotary_dim:
            q, k = _rotate(q, step.rope, self.rotary_dim), _rotate(k, step.rope, self.rotary_dim)
        if self.q_scale is not None:
            q = q * self.q_scale
        meta = step.attn_meta
        return self.o_proj(meta.backend.forward(q, k, v.contiguous(), kv_cache, meta, None))


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], rotary_dim: int) -> torch.Tensor:
    """Rotate-half rope on the first ``rotary_dim`` channels; the rest pass through."""
    cos, sin_signed = rope
    r = x[..., :rotary_dim]
    rotated = r * cos + torch.roll(r, rotary_dim // 2, dims=-1) * sin_signed
    return rotated if rotary_dim == x.shape[-1] else torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


def mamba_shape_of(cfg, *, heads: str, head_dim: str, groups: str, d_state: str, conv: str, chunk: str,
                   bias: str, conv_bias: str, act: str, eps: float, dt_limit=None) -> Mamba2Shape:
    """A :class:`Mamba2Shape` from the config fields named (each family names them its own way)."""
    if getattr(cfg, act, "silu") != "silu":
        raise ModelLoadError(f"Mamba2 activation {getattr(cfg, act)!r} is not supported (silu)")
    limit = tuple(dt_limit if dt_limit is not None else (getattr(cfg, "time_step_limit", None) or (0.0, float("inf"))))
    return Mamba2Shape(hidden_size=cfg.hidden_size, num_heads=getattr(cfg, heads), head_dim=getattr(cfg, head_dim),
                       n_groups=getattr(cfg, groups), d_state=getattr(cfg, d_state), conv_kernel=getattr(cfg, conv),
                       chunk_size=getattr(cfg, chunk), use_bias=bool(getattr(cfg, bias)),
                       use_conv_bias=bool(getattr(cfg, conv_bias)), norm_eps=eps,
                       dt_min=float(limit[0]), dt_max=float(limit[1]))


class HybridForCausalLM(nn.Module):
    """Base of the hybrid decoders. Subclasses set ``self.layers`` (each layer with ``.kind`` and
    its ``kv_index`` / ``state_index``), ``self.mamba`` (the :class:`Mamba2Shape` of its Mamba
    layers) and optionally ``self.rotary``, then call :meth:`_finish_init`."""

    # HF name prefixes to drop, and top-level HF names -> ours
    hf_prefixes: tuple[str, ...] = ("model.",)
    renames: dict[str, str] = {}
    embedding_multiplier = 1.0
    logits_scaling = 1.0

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        if tp.size > 1:
            self.check_tensor_parallel(hf_config, tp.size)
        self.hf_config = hf_config
        self.tp = tp
        self.kinds = layer_kinds(hf_config)
        self.rotary: RotaryEmbedding | None = None
        self.max_positions = max_positions

    def _finish_init(self, cfg, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        n_attn = self.kinds.count("attention")
        tie = bool(getattr(cfg, "tie_word_embeddings", False))
        self.args = HybridArgs(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=n_attn,
                               num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               max_positions=self.max_positions, tie_word_embeddings=tie,
                               layer_windows=(None,) * n_attn)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = None if tie else VocabEmbedding(cfg.vocab_size, cfg.hidden_size)

    @staticmethod
    def number_layers(kinds) -> tuple[list[int | None], list[int | None]]:
        """Per layer: its index among the attention layers (KV caches) and among the Mamba layers (states)."""
        kv, st = [], []
        n_attn = n_mamba = 0
        for k in kinds:
            kv.append(n_attn if k == "attention" else None)
            st.append(n_mamba if k == "mamba" else None)
            n_attn += k == "attention"
            n_mamba += k == "mamba"
        return kv, st

    @classmethod
    def check_tensor_parallel(cls, hf_config, size: int) -> None:
        if size > 1:
            raise ConfigError(f"{cls.__name__}: hybrid (Mamba2) models do not support tensor_parallel_size > 1 "
                              "yet; run them with tensor_parallel_size=1 (data_parallel_size scales them out)")

    # ------------------------------------------------------------------ what the engine reads

    @property
    def num_heads(self) -> int:
        return self.args.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.args.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.args.head_dim

    @property
    def num_state_layers(self) -> int:
        return self.kinds.count("mamba")

    def state_bytes_per_seq(self, dtype: torch.dtype) -> int:
        """One request's state slot over all Mamba layers (conv window in ``dtype``, SSM state fp32)."""
        return self.num_state_layers * self.mamba.state_bytes(dtype.itemsize)

    # ------------------------------------------------------------------ forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta,
                ssm: SSMStepMeta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        rope = self.rotary.lookup(positions, x.dtype) if self.rotary is not None else None
        step = HybridStep(rope=rope, kv_caches=kv_caches, attn_meta=meta, ssm=ssm)
        for layer in self.layers:
            x = layer(x, step)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits

    def checkpoint_layers(self) -> dict[str, tuple[Linear, list[str]]]:
        """Every :class:`Linear` by module name, for the loader's choice of storage
        (``quantization="int8"/"int4"`` quantizes these dense layers; the mixer's conv, A, D and
        norms stay dense). The checkpoint names only matter for GGUF files, which hybrids do not load."""
        return {name: (m, [f"{name}.weight"]) for name, m in self.named_modules() if isinstance(m, Linear)}

    def weight_shard(self, name: str):
        return None  # tensor parallelism is refused

    # ------------------------------------------------------------------ weights

    fused: dict[str, tuple[str, int]] = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                                         "v_proj": ("qkv_proj", 2)}

    def _our_name(self, hf_name: str) -> tuple[str, int | None]:
        name = hf_name
        for p in self.hf_prefixes:
            if name.startswith(p):
                name = name[len(p):]
                break
        head, _, rest = name.partition(".")
        if head in self.renames:
            name = self.renames[head] + ("." + rest if rest else "")
        parts = name.split(".")
        for i, p in enumerate(parts):
            if p in self.fused:
                parts[i], shard = self.fused[p]
                return ".".join(parts), shard
        return name, None

    def weight_targets(self, weights):
        """(HF name, target, part, tensor) per checkpoint tensor (worker/weight_update.py shares it)."""
        for hf_name, tensor in weights:
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, shard = self._our_name(hf_name)
            yield hf_name, target, shard, tensor

    def load_weights(self, weights) -> None:
        """(HF name, tensor) pairs into our modules; q/k/v (and gate/up where a model fuses them)
        into one projection. Anything missing or unexpected is an error: a wrong checkpoint fails
        loudly, not with garbage output."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for hf_name, target, shard, tensor in self.weight_targets(weights):
            loaded.add(load_tensor(self, modules, params, hf_name, target, shard, tensor))
        check_complete(modules, params, loaded)
