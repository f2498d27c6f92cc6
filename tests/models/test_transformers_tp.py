"""The Transformers backend's tensor-parallel plan (models/transformers_tp.py), in process: which
Linears split which way, the slices a rank reads, the refusals. End to end at TP=2:
test_transformers_backend.py."""
from __future__ import annotations

import pytest
import torch
import transformers

from asyncengine.errors import ConfigError
from asyncengine.layers.parallel import TPGroup
from asyncengine.models.transformers_tp import RowParallelLinear, shard_modules, tp_plan, weight_shard


def llama_config(**kw):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, architectures=["LlamaForCausalLM"])
    return transformers.LlamaConfig(**{**base, **kw})


def test_plan_shards_linears_and_names_the_slices():
    cfg = llama_config()
    tp = TPGroup(rank=1, size=2)
    plan = tp_plan(cfg, 2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    shard_modules(model.model, plan, tp)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attn.q_proj.weight.shape == (32, 64) and attn.k_proj.weight.shape == (16, 64)
    assert isinstance(attn.o_proj, RowParallelLinear) and attn.o_proj.weight.shape == (64, 32)
    assert mlp.gate_proj.weight.shape == (64, 64) and mlp.down_proj.weight.shape == (64, 64)
    assert model.model.embed_tokens.weight.shape == (512, 64)  # not in the plan: whole
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}

    def shard(name):
        return weight_shard(plan, tp, name, shapes[name])

    assert shard("model.layers.1.self_attn.q_proj.weight") == (0, 32, 64)
    assert shard("model.layers.0.self_attn.v_proj.weight") == (0, 16, 32)
    assert shard("model.layers.0.self_attn.o_proj.weight") == (1, 32, 64)
    assert shard("model.layers.0.mlp.down_proj.weight") == (1, 64, 128)
    assert shard("model.layers.0.input_layernorm.weight") is None
    assert shard("model.embed_tokens.weight") is None


def test_row_parallel_adds_its_bias_once():
    layer = RowParallelLinear(4, 3, True, TPGroup(rank=0, size=1))
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)


def test_refusals():
    with pytest.raises(ConfigError, match="4 attention heads do not split 3 ways"):
        tp_plan(llama_config(), 3)
    with pytest.raises(ConfigError, match="1 KV heads"):
        tp_plan(llama_config(num_key_value_heads=1), 2)
    with pytest.raises(ConfigError, match="colwise_gather_output"):
        tp_plan(transformers.Olmo2Config(architectures=["Olmo2ForCausalLM"]), 2)
