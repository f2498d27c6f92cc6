"""Which kind of layer each decoder layer of a hybrid checkpoint is, read from its HF config without
importing torch (the engine core decides its cache groups from this before any weight loads).

Kinds: ``"mamba"`` (a Mamba2 mixer: a state slot per request), ``"attention"`` (paged KV blocks),
``"mlp"`` and ``"moe"`` (NemotronH's feed-forward-only layers: no cache). The configs spell it
four ways: Mamba2 has only Mamba layers; Bamba lists ``attn_layer_indices``; GraniteMoeHybrid has
``layer_types`` ("mamba"/"attention"); NemotronH has ``hybrid_override_pattern`` (M = Mamba2,
* = attention, - = MLP, E = MoE) or, in transformers 5, ``layers_block_type``.
"""
from __future__ import annotations

from asyncengine.errors import ModelLoadError

# architectures whose layers keep a state per request (the engine gives them state slots)
STATE_SPACE_ARCHITECTURES = frozenset({"Mamba2ForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM",
                                       "GraniteMoeHybridForCausalLM"})

_NAMES = {"mamba": "mamba", "mamba2": "mamba", "linear_attention": "mamba", "m": "mamba",
          "attention": "attention", "full_attention": "attention", "*": "attention",
          "mlp": "mlp", "-": "mlp", "moe": "moe", "e": "moe"}


def has_state_layers(hf_config) -> bool:
    """Whether the checkpoint is one of the state-space architectures we run."""
    return any(a in STATE_SPACE_ARCHITECTURES for a in (getattr(hf_config, "architectures", None) or ()))


def layer_kinds(hf_config) -> tuple[str, ...]:
    """The kind of every layer, in order."""
    get = lambda name: getattr(hf_config, name, None)  # noqa: E731 (configs may be plain namespaces)
    model_type = get("model_type")
    if model_type == "mamba2":
        return ("mamba",) * get("num_hidden_layers")
    if model_type == "bamba" and get("attn_layer_indices") is not None:
        attn = set(get("attn_layer_indices"))
        return tuple("attention" if i in attn else "mamba" for i in range(get("num_hidden_layers")))
    listed = get("hybrid_override_pattern") or get("layers_block_type") or get("layer_types")
    if not listed:
        raise ModelLoadError(f"{model_type} config names no layer types (attn_layer_indices, layer_types, "
                             "layers_block_type or hybrid_override_pattern)")
    kinds = []
    for entry in listed:
        kind = _NAMES.get(str(entry).lower())
        if kind is None:
            raise ModelLoadError(f"{model_type}: unknown layer type {entry!r} in {listed!r}")
        kinds.append(kind)
    return tuple(kinds)
