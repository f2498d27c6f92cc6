"""Phi-3 / Phi-4-mini: the Llama decoder (models/llama.py) with its checkpoint's q/k/v and gate/up
already fused (``qkv_proj``, ``gate_up_proj``: they load whole into our fused layers), LongRoPE
("su") and partial rotary (layers/rotary.py). Tied embeddings (Phi-4-mini) as Llama's.

One rank only for now: the fused checkpoint tensors would need a per-part slice per rank."""
from __future__ import annotations

from asyncengine.errors import ConfigError
from asyncengine.layers.linear import QuantizedTensor
from asyncengine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def check_tensor_parallel(cls, hf_config, size: int) -> None:
        if size > 1:
            raise ConfigError("Phi3ForCausalLM: tensor parallel is not supported yet (its checkpoint fuses "
                              "q/k/v and gate/up, which a rank would have to slice part by part)")

    def checkpoint_layers(self):
        """Llama's, with each fused layer filled by its one fused checkpoint tensor, so that a GGUF's
        block-format ``attn_qkv`` / ``ffn_up`` stay in their blocks (loader.choose_weight_storage)."""
        out = super().checkpoint_layers()
        for name, (layer, names) in out.items():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("qkv_proj", "gate_up_proj"):
                out[name] = (layer, [f"{names[0].rsplit('.', 2)[0]}.{leaf}.weight"])
        return out

    def weight_targets(self, weights):
        """Llama's mapping, with each fused checkpoint tensor cut into our fused layer's parts (rows;
        a block-format tensor by whole rows of blocks)."""
        for name, target, shard, tensor in super().weight_targets(weights):
            leaf = target.rsplit(".", 2)[-2] if target.count(".") >= 1 else ""
            if shard is None and leaf in ("qkv_proj", "gate_up_proj") and target.endswith(".weight"):
                module = self.get_submodule(target.removesuffix(".weight"))
                start = 0
                for i, rows in enumerate(module.parts):
                    yield name, target, i, (tensor.rows(start, start + rows) if isinstance(tensor, QuantizedTensor)
                                            else tensor[start:start + rows])
                    start += rows
            else:
                yield name, target, shard, tensor
