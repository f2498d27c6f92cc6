"""Tensor-parallel sharding, in process (no worker processes): which slice of each weight a rank
loads from safetensors and from GGUF, that the shards hold ~1/N of the bytes, and the refusal of
models whose heads do not split. The end-to-end runs with worker processes are in
test_tensor_parallel.py."""
from __future__ import annotations

import pytest
import torch

from asyncengine.config import EngineConfig
from asyncengine.errors import ConfigError
from asyncengine.layers.parallel import TPGroup, attention_shard
from asyncengine.kernels.cpu import quant
from asyncengine.layers.linear import Linear, weight_nbytes
from asyncengine.models.loader import load_model

H, I, V, D = 64, 128, 512, 16  # the tiny llama: hidden, intermediate, vocab, head_dim (4 heads, 2 KV)


def expected_local(name: str, full: torch.Tensor, rank: int, n: int, heads=4, kv_heads=2, head_dim=D,
                   inter=I, vocab=V, vocab_parallel=True) -> torch.Tensor:
    """This rank's part of the TP=1 parameter, written out by hand (not with the code under test)."""
    hq = heads // n
    kv_per = max(1, kv_heads // n)
    kv0 = rank * kv_per if kv_heads >= n else rank * kv_heads // n
    if name.endswith("qkv_proj.weight"):
        q = full[:heads * head_dim][rank * hq * head_dim:(rank + 1) * hq * head_dim]
        k = full[heads * head_dim:(heads + kv_heads) * head_dim][kv0 * head_dim:(kv0 + kv_per) * head_dim]
        v = full[(heads + kv_heads) * head_dim:][kv0 * head_dim:(kv0 + kv_per) * head_dim]
        return torch.cat([q, k, v])
    if name.endswith("o_proj.weight"):
        return full[:, rank * hq * head_dim:(rank + 1) * hq * head_dim]
    if name.endswith("gate_up_proj.weight"):
        per = inter // n
        return torch.cat([full[:inter][rank * per:(rank + 1) * per], full[inter:][rank * per:(rank + 1) * per]])
    if name.endswith("down_proj.weight"):
        per = inter // n
        return full[:, rank * per:(rank + 1) * per]
    if name in ("embed_tokens.weight", "lm_head.weight") and vocab_parallel:
        per = -(-vocab // n)
        part = full[rank * per:(rank + 1) * per]
        return torch.cat([part, part.new_zeros(per - part.shape[0], part.shape[1])])
    return full  # norms (and a replicated vocabulary): whole on every rank


def dense_weights(model) -> dict[str, torch.Tensor]:
    """Every weight by parameter name, dequantized where a layer keeps blocks."""
    out = {n: p.detach() for n, p in model.named_parameters()}
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.quantized:
            out[f"{name}.weight"] = quant.dequantize_torch(m.qweight, m.qtype, m.in_features)
    return out


def check_shards(path: str, n: int, vocab_parallel: bool = True, check_bytes: bool = True, **cfg) -> None:
    config = EngineConfig(model=path, dtype="float32", skip_tokenizer_init=True, **cfg)
    full_model = load_model(config, tokenizer=False).model
    full, full_bytes = dense_weights(full_model), weight_nbytes(full_model)
    vocab_bytes = weight_nbytes(torch.nn.ModuleList(
        [m for m in (full_model.embed_tokens, getattr(full_model, "lm_head", None)) if m is not None]))
    for rank in range(n):
        shard = load_model(config, tp=TPGroup(rank=rank, size=n, vocab_parallel=vocab_parallel),
                           tokenizer=False).model
        params = dense_weights(shard)
        assert params.keys() == full.keys()
        for name, p in params.items():
            torch.testing.assert_close(p, expected_local(name, full[name], rank, n, vocab_parallel=vocab_parallel),
                                       rtol=0, atol=0, msg=lambda m: f"rank {rank} {name}: {m}")
        # everything but the norms is split: about 1/N of the bytes (the vocabulary whole if replicated)
        if check_bytes:
            want = 1 / n if vocab_parallel else (vocab_bytes + (full_bytes - vocab_bytes) / n) / full_bytes
            assert abs(weight_nbytes(shard) / full_bytes - want) < 0.02, (rank, weight_nbytes(shard), full_bytes)


@pytest.mark.parametrize("n", [2, 4])
def test_safetensors_shards(tiny_llama_dir, n):
    check_shards(tiny_llama_dir, n)


def test_replicated_vocabulary_shards(tiny_llama_dir):
    """tp_vocab_parallel=False: the embedding and LM head whole on every rank, the rest split."""
    check_shards(tiny_llama_dir, 2, vocab_parallel=False)


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory, tiny_llama_dir):
    from gguf_utils import write_tiny_gguf

    d = tmp_path_factory.mktemp("tp-gguf")
    return {q: str(write_tiny_gguf(d / f"llama-{q}.gguf", tiny_llama_dir, None, qtype=q)) for q in ("F32", "Q8_0")}


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("n", [2, 4])
def test_gguf_shards(llama_gguf, qtype, n):
    """Dequantized at load: row slices straight from the memory map (q/k unpermuted per head),
    column slices on block edges (TP=2: 32 columns) and off them (TP=4: 16 of a Q8_0 block's 32),
    KV heads replicated at 4."""
    check_shards(llama_gguf[qtype], n, quantization="none")


@pytest.mark.parametrize("n", [2, 4])
def test_gguf_shards_stay_quantized(llama_gguf, n):
    """Kept in Q8_0 blocks: each rank's blocks are its slice of the whole model's. At TP=4 the
    row-parallel o_proj gets 16 input features, half a block: that layer alone loads dense."""
    check_shards(llama_gguf["Q8_0"], n, check_bytes=n == 2)
    shard = load_model(EngineConfig(model=llama_gguf["Q8_0"], dtype="float32", skip_tokenizer_init=True),
                       tp=TPGroup(rank=1, size=n), tokenizer=False).model
    formats = {name.rsplit(".", 1)[-1]: m.qtype for name, m in shard.named_modules() if isinstance(m, Linear)}
    assert formats == {"qkv_proj": "Q8_0", "o_proj": "Q8_0" if n == 2 else None, "gate_up_proj": "Q8_0",
                       "down_proj": "Q8_0", "embed_tokens": "Q8_0", "lm_head": "Q8_0"}


def test_gguf_replicated_vocabulary(llama_gguf):
    check_shards(llama_gguf["Q8_0"], 2, vocab_parallel=False)


def test_refuses_heads_that_do_not_split(tiny_model_dir):
    with pytest.raises(ConfigError, match="9 query heads"):
        attention_shard(9, 3, TPGroup(rank=0, size=2))
    with pytest.raises(ConfigError, match="KV heads"):
        attention_shard(8, 3, TPGroup(rank=0, size=2))
    assert attention_shard(4, 1, TPGroup(rank=1, size=2)).num_kv_heads == 1  # MQA: replicated
    # SmolLM2's shape (9 query heads, 3 KV heads): refused before any worker process starts
    from asyncengine.engine_core.core import EngineCore

    d = tiny_model_dir("llama", hidden_size=72, num_attention_heads=9, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="does not divide the model's 9 query heads"):
        EngineCore(EngineConfig(model=d, dtype="float32", tensor_parallel_size=2))


def test_config_validation():
    with pytest.raises(ConfigError, match="'uni' runs one worker"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    assert EngineConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert EngineConfig().distributed_executor_backend == "uni"
    with pytest.raises(ConfigError):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ConfigError):
        EngineConfig(distributed_executor_backend="slurm")
