"""Mixture-of-experts members of the Llama family: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE (whose
q/k norms span all heads: :class:`OlmoeAttention`) and Granite MoE (stacked experts, four scalars).

Each is a Llama decoder (models/llama.py: attention, norms, embedding, head, tensor and pipeline
parallel) whose MLP is, on its sparse layers, a :class:`~asyncengine.layers.moe.SparseMoE`. What
differs is read from the config: the router (Mixtral always renormalises its top k, the others as
``norm_topk_prob`` says), Qwen2-MoE's gated shared expert, Qwen2/3-MoE's dense layers
(``mlp_only_layers``, ``decoder_sparse_step``), and the checkpoint names of the experts
(``block_sparse_moe.experts.N.w1/w3/w2`` or ``mlp.experts.N.gate_proj/up_proj/down_proj``).

The expert tensors bypass the Llama loader's fusing (their ``gate_proj`` is not the dense MLP's):
:meth:`MoeLlamaForCausalLM.load_weights` hands them to their layer, then checks every owned
expert was filled. Block-quantized experts (GGUF files) run as one C call per layer
(layers/moe_native.py), in the per-op model and in the native decode step alike.
"""
from __future__ import annotations

import dataclasses
import re

from asyncengine.errors import ConfigError
from asyncengine.layers.moe import ExpertShard, SparseMoE
from asyncengine.layers.moe_router import RouterSpec
from asyncengine.layers.parallel import FULL, SINGLE, PPGroup, TPGroup, even_split
from asyncengine.layers.norm import RMSNorm
from asyncengine.layers.rotary import apply_rotary
from asyncengine.models.llama import MLP, Attention, LlamaForCausalLM
from asyncengine.models.weight_loading import check_complete, load_tensor

# (layer prefix, expert, projection) of an expert tensor, in our (renamed) naming
_EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(layers\.\d+\.mlp)\.(input_linear|output_linear)\.weight$")
_KIND = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
# transformers 5's in-memory experts (``named_parameters``): [E, 2I, H] ([gate | up]) and [E, H, I]
_FUSED_EXPERTS = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$")


class PartialMLP(MLP):
    """A dense gated MLP whose output stays this rank's partial sum (the MoE layer's one
    all-reduce completes it with the experts')."""

    def forward(self, x):
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class ReducedMoE(SparseMoE):
    def __init__(self, *args, tp: TPGroup = SINGLE, **kw) -> None:
        super().__init__(*args, tp=tp, expert_parallel=tp.expert_parallel, **kw)
        self.tp = tp

    def forward(self, x):
        return self.tp.all_reduce(super().forward(x))


class MoeLlamaForCausalLM(LlamaForCausalLM):
    """Base of the MoE members: builds the Llama decoder, then swaps each sparse layer's MLP."""

    is_moe = True
    renames: dict[str, str] = {}
    num_experts_field = "num_experts"
    always_renormalize = False
    router_kind = "softmax_topk"
    shared_inter = 0  # Qwen2-MoE: the shared expert's intermediate size

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE, pp: PPGroup = FULL) -> None:
        super().__init__(hf_config, max_positions, tp, pp)
        c = hf_config
        self.spec = RouterSpec(num_experts=getattr(c, self.num_experts_field), top_k=c.num_experts_per_tok,
                               kind=self.router_kind, renormalize=self.always_renormalize or bool(getattr(c, "norm_topk_prob", False)))
        self.moe_inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        for j, layer in enumerate(self.layers):
            if self.is_sparse(c, self.start_layer + j):
                shared = self.make_shared(c)
                layer.mlp = ReducedMoE(self.args.hidden_size, self.moe_inter, self.spec, self.args.hidden_act,
                                       tp=tp, shared=shared, shared_gate=self.shared_gated and shared is not None,
                                       expert_linears=bool(getattr(c, "expert_linears", False)))

    shared_gated = False

    def make_shared(self, c):
        return None

    @staticmethod
    def is_sparse(c, i: int) -> bool:
        step = getattr(c, "decoder_sparse_step", None) or 1
        return i not in (getattr(c, "mlp_only_layers", None) or ()) and (i + 1) % step == 0

    @classmethod
    def check_tensor_parallel(cls, hf_config, size: int, expert_parallel: bool = False) -> None:
        """As Llama's, plus the experts: split whole over the ranks (``expert_parallel``) or by
        columns; a shared expert or dense layer splits as the dense MLP."""
        super().check_tensor_parallel(hf_config, size)
        a, tp = hf_config, TPGroup(rank=0, size=size)
        inter = getattr(a, "moe_intermediate_size", None) or a.intermediate_size
        ExpertShard.of(getattr(a, cls.num_experts_field), inter, tp, expert_parallel)
        if getattr(a, "shared_expert_intermediate_size", 0):
            even_split(a.shared_expert_intermediate_size, tp, "shared expert intermediate size")

    def moe_layers(self) -> list[SparseMoE]:
        return [m for m in self.modules() if isinstance(m, SparseMoE)]

    def _rename(self, name: str) -> str:
        for a, b in self.renames.items():
            name = name.replace(a, b)
        return name

    def weight_shard(self, name: str):
        if self.tp.size == 1:
            return None
        m = _EXPERT.match(self._rename(name.removeprefix("model.")))
        if m is not None:
            moe = self._moe_of(m.group(1))
            if moe is None or not moe.owns(int(m.group(2))):
                return 0, 0, 0  # another rank's expert (or stage's layer): read nothing
            return moe.expert_slice(_KIND[m.group(3)])
        leaf = name.rsplit(".", 2)
        kind = leaf[-2] if len(leaf) >= 2 else name
        if kind in ("gate", "shared_expert_gate"):
            return None
        if ".shared_expert." in name:
            inter = self.shared_inter // self.tp.size
            start = self.tp.rank * inter
            return (1, start, start + inter) if kind == "down_proj" else (0, start, start + inter)
        return super().weight_shard(name)

    def _moe_of(self, prefix: str):
        local = self.local_name(prefix)
        if local is None:
            return None
        return dict(self.named_modules()).get(local)

    def weight_targets(self, weights):
        """As Llama's, plus the experts, for the in-place weight update (the loader takes them
        before this): each expert tensor, per-expert or stacked (Granite's ``input_linear``,
        transformers 5's ``experts.gate_up_proj``), becomes one (per-expert name, part of ``w13`` /
        ``w2``) entry per expert this rank owns (:meth:`SparseMoE.part_of`); the per-expert name
        lets the caller take this rank's slice with :meth:`weight_shard`."""
        def split():
            for name, tensor in weights:
                name = self._rename(name)
                bare = name.removeprefix("model.")
                st, fu = _STACKED.match(bare), _FUSED_EXPERTS.match(bare)
                if st is None and fu is None:
                    yield name, tensor
                    continue
                prefix = (st or fu).group(1)
                if (st or fu).group(2) in ("input_linear", "gate_up_proj"):
                    half = tensor.shape[1] // 2
                    for e in range(tensor.shape[0]):
                        yield f"{prefix}.experts.{e}.gate_proj.weight", tensor[e, :half]
                        yield f"{prefix}.experts.{e}.up_proj.weight", tensor[e, half:]
                else:
                    for e in range(tensor.shape[0]):
                        yield f"{prefix}.experts.{e}.down_proj.weight", tensor[e]

        for name, tensor in split():
            m = _EXPERT.match(name.removeprefix("model."))
            if m is None:
                yield from super().weight_targets([(name, tensor)])
                continue
            moe, e, kind = self._moe_of(m.group(1)), int(m.group(2)), _KIND[m.group(3)]
            if moe is not None and moe.owns(e):
                leaf = "w2" if kind == "down" else "w13"
                yield name, f"{self.local_name(m.group(1))}.{leaf}", moe.part_of(e, kind), tensor

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        sliced = self.tp.size > 1

        stacked: dict[str, dict] = {}

        def dense():
            for name, tensor in weights:
                name = self._rename(name)
                m = _EXPERT.match(name.removeprefix("model."))
                st = _STACKED.match(name.removeprefix("model."))
                if st is not None:  # Granite: all experts of a layer in one tensor
                    stacked.setdefault(st.group(1), {})[st.group(2)] = tensor
                    continue
                if m is None:
                    yield name, tensor
                    continue
                local = self.local_name(m.group(1))
                if local is not None:
                    modules[local].load_expert(int(m.group(2)), _KIND[m.group(3)], tensor, sliced)

        for name, target, shard, tensor in self.weight_targets(dense()):
            loaded.add(load_tensor(self, modules, params, name, target, shard, tensor))
        for prefix, parts in stacked.items():
            local = self.local_name(prefix)
            if local is not None:
                modules[local].load_stacked(parts["input_linear"], parts["output_linear"])
        for prefix, moe in modules.items():
            if isinstance(moe, SparseMoE):
                missing = moe.missing()
                if missing:
                    raise KeyError(f"checkpoint is missing {len(missing)} expert tensors of {prefix}, e.g. {missing[:3]}")
                loaded |= moe.loaded_keys(prefix)
        check_complete(modules, params, loaded)


class MixtralForCausalLM(MoeLlamaForCausalLM):
    renames = {".block_sparse_moe.": ".mlp."}
    num_experts_field = "num_local_experts"
    always_renormalize = True

    @staticmethod
    def is_sparse(c, i: int) -> bool:
        return True


class Qwen2MoeForCausalLM(MoeLlamaForCausalLM):
    qkv_bias = True
    shared_gated = True

    def make_shared(self, c):
        inter = getattr(c, "shared_expert_intermediate_size", 0) or 0
        self.shared_inter = inter
        if not inter:
            return None
        return PartialMLP(dataclasses.replace(self.args, intermediate_size=inter), self.tp)


class Qwen3MoeForCausalLM(MoeLlamaForCausalLM):
    qk_norm = True
    # the stored name: ``num_experts`` is only an alias of the config class, which a worker process's
    # plain copy of the config (loader: SimpleNamespace of to_dict()) does not keep
    num_experts_field = "num_local_experts"


class OlmoeAttention(Attention):
    """OLMoE: q and k are normalised over the whole projection (all heads at once, not per head)
    before rope, and q/k/v are clipped to ±``clip_qkv`` where the config sets it."""

    def __init__(self, a, rotary, tp: TPGroup, window, clip: float | None) -> None:
        super().__init__(a, rotary, tp, window)
        self.q_norm = RMSNorm(self.q_size, a.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, a.rms_norm_eps)
        self.clip = clip

    def forward(self, x, rope, kv_cache, meta):
        t, hq, hk, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, :self.q_size].contiguous())
        k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].contiguous())
        v = qkv[:, self.q_size + self.kv_size:].contiguous()
        if self.clip is not None:
            q, k, v = (z.clamp_(-self.clip, self.clip) for z in (q, k, v))
        q, k = apply_rotary(q.view(t, hq, d), *rope), apply_rotary(k.view(t, hk, d), *rope)
        out = meta.backend.forward(q, k, v.view(t, hk, d), kv_cache, meta, self.sliding_window)
        return self.tp.all_reduce(self.o_proj(out))


class OlmoeForCausalLM(MoeLlamaForCausalLM):
    native_step_unsupported = "OLMoE's q/k norms span all heads (the native step norms each head)"

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE, pp: PPGroup = FULL) -> None:
        super().__init__(hf_config, max_positions, tp, pp)
        clip = getattr(hf_config, "clip_qkv", None)
        for layer in self.layers:
            old = layer.self_attn
            layer.self_attn = OlmoeAttention(self.args, self.rotary, tp, old.sliding_window, clip)

    @classmethod
    def check_tensor_parallel(cls, hf_config, size: int, expert_parallel: bool = False) -> None:
        if size > 1:
            raise ConfigError("OLMoE under tensor parallel is not supported: its q/k norms span every "
                              "head, which a head-split rank does not hold")


class GraniteMoeForCausalLM(MoeLlamaForCausalLM):
    """Granite MoE: Llama + stacked experts (``block_sparse_moe.input_linear`` [E, 2I, H],
    ``output_linear``), a top-k-then-softmax router, and Granite's four scalars: embeddings x
    ``embedding_multiplier``, each branch x ``residual_multiplier``, the softmax scale
    ``attention_multiplier``, logits / ``logits_scaling``."""

    native_step_unsupported = "Granite's multipliers are not in the native step"

    renames = {".block_sparse_moe.router.layer.": ".mlp.gate.", ".block_sparse_moe.router.": ".mlp.gate.",
               ".block_sparse_moe.": ".mlp."}
    num_experts_field = "num_local_experts"
    router_kind = "topk_softmax"

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE, pp: PPGroup = FULL) -> None:
        super().__init__(hf_config, max_positions, tp, pp)
        c = hf_config
        self.logits_scaling = float(getattr(c, "logits_scaling", 1.0))
        for layer in self.layers:
            layer.residual_multiplier = float(getattr(c, "residual_multiplier", 1.0))
            layer.self_attn.q_scale = float(c.attention_multiplier) * self.args.head_dim ** 0.5
        mult = float(getattr(c, "embedding_multiplier", 1.0))
        if self.embed_tokens is not None and mult != 1.0:
            self.embed_tokens.register_forward_hook(lambda _m, _i, out: out * mult)

    def compute_logits(self, hidden):
        logits = super().compute_logits(hidden)
        return None if logits is None else logits / self.logits_scaling
