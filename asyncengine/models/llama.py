"""The Llama family in plain torch: Llama, Mistral, Qwen2 (QKV bias) and Qwen3 (per-head q/k norm).

One decoder serves all four; the differences are three config switches. Weights are loaded from
HF names and fused on the way in (q/k/v into one projection, gate/up into one) so each layer is
four matmuls on a flat [tokens, hidden] batch.

Tensor parallel (Megatron): a model built with a ``TPGroup`` of size N holds 1/N of the attention
heads (q/k/v rows; KV heads replicated when there are fewer than N), of the MLP columns (gate/up
rows, down columns) and of the vocabulary (embedding rows and LM head rows); o_proj and down_proj
produce partial sums that one all-reduce each completes. :meth:`weight_shard` tells the loader which
slice of each checkpoint tensor this rank reads, so no rank ever materializes the whole model.

Pipeline parallel: a model built with a ``PPGroup`` holds only its stage's layers (the first stage
the embedding, the last the norm and the head); a stage other than the last returns the stream as
``(hidden, residual)`` for the next, which takes it as ``intermediate``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asyncengine.layers.activation import ActAndMul
from asyncengine.layers.linear import Linear, VocabEmbedding
from asyncengine.layers.norm import RMSNorm
from asyncengine.layers.parallel import FULL, SINGLE, PPGroup, TPGroup, attention_shard, even_split, vocab_split
from asyncengine.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from asyncengine.models.weight_loading import check_complete, load_tensor


@dataclass
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    # per layer: its sliding attention window (a query sees the last W positions), or None
    layer_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_hf(cls, cfg, max_positions: int, qkv_bias: bool, qk_norm: bool) -> "LlamaArgs":
        heads = cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps, rope=rope_parameters(cfg), max_positions=max_positions,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias or bool(getattr(cfg, "attention_bias", False)), qk_norm=qk_norm,
            hidden_act=getattr(cfg, "hidden_act", "silu"), layer_windows=sliding_windows(cfg))


def sliding_windows(cfg) -> tuple[int | None, ...]:
    """The sliding window of every layer, as transformers applies it: ``layer_types`` says which
    layers slide (Qwen2: from ``max_window_layers`` on); without it (Mistral) all do, when
    ``sliding_window`` is set and ``use_sliding_window`` is not False."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if not window or not getattr(cfg, "use_sliding_window", True):
        return (None,) * n
    types = getattr(cfg, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * n


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs, rotary: RotaryEmbedding, tp: TPGroup = SINGLE,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        sh = attention_shard(a.num_heads, a.num_kv_heads, tp)
        self.tp = tp
        self.q_size = sh.num_heads * a.head_dim
        self.kv_size = sh.num_kv_heads * a.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = sh.num_heads, sh.num_kv_heads, a.head_dim
        self.qkv_proj = Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.qkv_bias,
                               parts=(self.q_size, self.kv_size, self.kv_size))
        self.o_proj = Linear(self.q_size, a.hidden_size, bias=False)  # row-parallel
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.rotary = rotary
        self.sliding_window = sliding_window  # None: full attention; the backend applies it
        self.softcap: float | None = None  # Gemma 2: the backend caps the scores (cap * tanh(s / cap))
        self.q_scale = None  # Granite: q x this makes the softmax scale attention_multiplier

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache, meta):
        """rope: this step's (cos, signed sin) rows, from :meth:`RotaryEmbedding.lookup`; meta: the
        step's attention metadata, built by the runner's attention backend (``meta.backend``)."""
        t = x.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(t, hk, d)
        if self.q_norm is None:
            # q and k sit side by side in the fused projection: rotate them in one go
            qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(t, hq + hk, d), *rope)
            q, k = qk[:, :hq], qk[:, hq:]
        else:
            q = self.q_norm(qkv[:, :self.q_size].view(t, hq, d))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(t, hk, d))
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if self.q_scale is not None:
            q = q * self.q_scale
        extra = {} if self.softcap is None else {"softcap": self.softcap}  # refused at start by backends without
        out = meta.backend.forward(q, k, v, kv_cache, meta, self.sliding_window, **extra)
        return self.tp.all_reduce(self.o_proj(out))


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        _, self.inter = even_split(a.intermediate_size, tp, "intermediate size")
        self.gate_up_proj = Linear(a.hidden_size, 2 * self.inter, bias=False, parts=(self.inter, self.inter))
        self.down_proj = Linear(self.inter, a.hidden_size, bias=False)  # row-parallel
        self.act_and_mul = ActAndMul(a.hidden_act)

    def forward(self, x):
        return self.tp.all_reduce(self.down_proj(self.act_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs, rotary: RotaryEmbedding, tp: TPGroup = SINGLE,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(a, rotary, tp, sliding_window)
        self.mlp = MLP(a, tp)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.residual_multiplier = 1.0  # Granite: each branch's output scaled before it joins the stream

    def forward(self, x, rope, kv_cache, meta, residual=None):
        """x: the previous layer's MLP output (the embeddings for the first layer, residual None).
        Returns (MLP output, residual): their sum, the stream, is made by the next norm's fused
        add (the same sums, in one op fewer per layer)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual=residual)
        attn = self.self_attn(h, rope, kv_cache, meta)
        m = self.residual_multiplier
        h, residual = self.post_attention_layernorm(attn if m == 1.0 else attn * m, residual=residual)  # fused add + norm
        return (self.mlp(h), residual) if m == 1.0 else (self.mlp(h) * m, residual)


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral; Qwen2/Qwen3 are the subclasses below."""

    lora_active = False  # this step has LoRA rows (lora/hooks.py adds their products; the native step too)
    lora = None  # the LoRAModel hooked on this model (lora/hooks.py): the native step reads its slots

    qkv_bias = False
    qk_norm = False

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE, pp: PPGroup = FULL) -> None:
        super().__init__()
        a = LlamaArgs.from_hf(hf_config, max_positions, self.qkv_bias, self.qk_norm)
        self.args = a
        self.tp = tp
        self.pp = pp
        self.start_layer, self.end_layer = pp.layer_range(a.num_layers)
        self.shard = attention_shard(a.num_heads, a.num_kv_heads, tp)
        self.inter_start, _ = even_split(a.intermediate_size, tp, "intermediate size")
        # vocab-parallel embedding and head: each rank holds `rows` rows (the last may pad); or
        # replicated (tp.vocab_parallel False): every rank holds all of them
        self.vocab_start, self.vocab_stop, rows = vocab_split(a.vocab_size, tp)
        valid = self.vocab_stop - self.vocab_start
        # no random init: the loader fills them. The embedding on the first stage, and on the last
        # when it is also the head (tied)
        self.embed_tokens = VocabEmbedding(rows, a.hidden_size, valid) \
            if pp.is_first or (pp.is_last and a.tie_word_embeddings) else None
        rotary = RotaryEmbedding(a.head_dim, max_positions, a.rope)
        self.rotary = rotary
        windows = a.layer_windows or (None,) * a.num_layers
        self.layers = nn.ModuleList(DecoderLayer(a, rotary, tp, w) for w in windows[self.start_layer:self.end_layer])
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps) if pp.is_last else None
        self.lm_head = None if a.tie_word_embeddings or not pp.is_last \
            else VocabEmbedding(rows, a.hidden_size, valid)
        # the decoder layers of a step as one C call (models/llama_native.py), set by the worker
        # where it applies (one pipeline stage only); None = every step runs the per-op code below
        self.native_step = None

    @classmethod
    def check_tensor_parallel(cls, hf_config, size: int) -> None:
        """Raise ConfigError, before any worker starts, if the model cannot be split ``size`` ways."""
        a = LlamaArgs.from_hf(hf_config, 1, cls.qkv_bias, cls.qk_norm)
        tp = TPGroup(rank=0, size=size)
        attention_shard(a.num_heads, a.num_kv_heads, tp)
        even_split(a.intermediate_size, tp, "intermediate size")

    @property
    def num_heads(self) -> int:
        """Query heads on this rank."""
        return self.shard.num_heads

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank: what its KV cache holds."""
        return self.shard.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.args.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta, intermediate=None, inputs_embeds=None):
        """The last stage's final hidden states; another stage's ``(hidden, residual)`` (for the
        next, which gets them as ``intermediate``). ``kv_caches``: this stage's layers' only.
        ``inputs_embeds``: the rows to start from instead of ``input_ids``' (images: models/llava.py)."""
        if intermediate is not None:
            x, residual = intermediate
        else:
            x, residual = (self.embed(input_ids) if inputs_embeds is None else inputs_embeds), None
        rope = self.rotary.lookup(positions, x.dtype)
        if self.native_step is not None and intermediate is None and self.native_step.accepts(x.shape[0], meta):
            return self.native_step(x, rope, kv_caches, meta)
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, rope, kv, meta, residual)
        if not self.pp.is_last:
            return x, residual
        return self.norm(x) if residual is None else self.norm(x, residual=residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embedding rows (a collective under a vocab-sharded tensor parallel group)."""
        if not self.tp.vocab_sharded:
            return self.embed_tokens(input_ids)
        # rows outside this rank's vocabulary slice contribute zeros to the all-reduce
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_stop - self.vocab_start)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary on rank 0; None on the other ranks (a collective under
        tensor parallelism: every rank must call it with the same rows)."""
        if not self.tp.vocab_sharded and self.tp.rank > 0:
            return None  # a replicated head: rank 0 computes every logit alone
        logits = (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)
        if not self.tp.vocab_sharded:
            return logits
        full = self.tp.gather_to_first(logits, dim=-1)
        return None if full is None else full[:, :self.args.vocab_size]

    def weight_shard(self, name: str) -> tuple[int, int, int] | None:
        """The slice ``(dim, start, stop)`` of checkpoint tensor ``name`` (HF naming) this rank
        holds, or None for a replicated tensor (norms). The loader reads only that slice."""
        if self.tp.size == 1:
            return None
        a, sh = self.args, self.shard
        d = a.head_dim
        leaf = name.rsplit(".", 2)
        kind = leaf[-2] if len(leaf) >= 2 else name
        if kind == "q_proj":
            return 0, sh.q_head_start * d, (sh.q_head_start + sh.num_heads) * d
        if kind in ("k_proj", "v_proj"):
            return 0, sh.kv_head_start * d, (sh.kv_head_start + sh.num_kv_heads) * d
        if kind == "o_proj":
            return 1, sh.q_head_start * d, (sh.q_head_start + sh.num_heads) * d
        inter = a.intermediate_size // self.tp.size
        if kind in ("gate_proj", "up_proj"):
            return 0, self.inter_start, self.inter_start + inter
        if kind == "down_proj":
            return 1, self.inter_start, self.inter_start + inter
        if kind in ("embed_tokens", "lm_head"):
            return (0, self.vocab_start, self.vocab_stop) if self.tp.vocab_sharded else None
        return None

    # ------------------------------------------------------------------ weights

    def local_name(self, name: str) -> str | None:
        """A checkpoint name (no ``model.`` prefix) as this stage's module holds it (its layers
        numbered from 0), or None for a tensor of another stage."""
        if self.pp.size == 1:
            return name
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            i = int(i)
            return f"layers.{i - self.start_layer}.{rest}" if self.start_layer <= i < self.end_layer else None
        if name.startswith("embed_tokens."):
            return name if self.embed_tokens is not None else None
        if name.startswith(("norm.", "lm_head.")):
            return name if self.pp.is_last else None
        return name

    def checkpoint_name(self, name: str) -> str:
        """The inverse of :meth:`local_name` for this stage's modules."""
        if self.pp.size > 1 and name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            return f"layers.{int(i) + self.start_layer}.{rest}"
        return name

    def checkpoint_layers(self) -> dict[str, tuple[Linear, list[str]]]:
        """Every :class:`Linear` (by module name) with the checkpoint weights (HF names without the
        ``model.`` prefix) that fill it, in part order: the loader picks each layer's storage from
        them (quantized blocks only where every part is in the same block format)."""
        parts = {}
        for src, (dst, i) in _FUSED.items():
            parts.setdefault(dst, {})[i] = src
        out = {}
        for name, m in self.named_modules():
            if isinstance(m, Linear):
                prefix, _, leaf = self.checkpoint_name(name).rpartition(".")
                leaves = [parts[leaf][i] for i in sorted(parts[leaf])] if leaf in parts else [leaf]
                out[name] = (m, [f"{prefix}.{x}.weight" if prefix else f"{x}.weight" for x in leaves])
        return out

    def weight_targets(self, weights):
        """(HF name, target, part, tensor) for each (HF name, tensor) this stage holds: ``target``
        names our parameter (q/k/v and gate/up fused: ``part`` says which), None for a whole one.
        Tensors of other stages, the rotary table and a tied head are skipped. The loader and the
        in-place weight update (worker/weight_update.py) share this one mapping."""
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            local = self.local_name(name.removeprefix("model."))
            if local is None:
                continue  # another pipeline stage's
            if local == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the head
            parts = local.split(".")
            target, shard = local, None
            for i, p in enumerate(parts):
                if p in _FUSED:
                    parts[i], shard = _FUSED[p]
                    target = ".".join(parts)
                    break
            yield local, target, shard, tensor

    def load_weights(self, weights) -> None:
        """Take (HF name, tensor) pairs (a tensor may be a ``QuantizedTensor``: GGUF blocks); fuse
        q/k/v and gate/up; complain about anything missing or unexpected so a wrong checkpoint fails
        loudly, not with garbage output."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, target, shard, tensor in self.weight_targets(weights):
            loaded.add(load_tensor(self, modules, params, name, target, shard, tensor))
        check_complete(modules, params, loaded)


# checkpoint projection -> (our fused layer, part index)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class MistralForCausalLM(LlamaForCausalLM):
    pass
