"""K-quant GGUFs (Q4_K, Q5_K, Q6_K) run from their own blocks, end to end: a tiny Llama written
with a Q4_K_M-like mix (Q4_K, Q5_K attention in one layer, Q6_K ffn_down and output) generates,
greedy in fp32, what transformers generates from the same file's dequantized weights (near-tie
rule); the native decode step equals the per-op path in fp32 and int8 activations; every
projection holds the file's bytes (no dequantized copy), and a fused layer whose parts mix
formats (Q4_K q/k, Q6_K v) is re-quantized to Q8_0 and keeps the native step."""
from __future__ import annotations

import random

import pytest
import torch
from gguf_utils import tiny_hf_model, tiny_tokenizer, write_tiny_gguf
from test_gguf import _transformers_gguf_model, assert_greedy_parity
from test_llama_native import REQUESTS, run

from asyncengine import LLM, SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.models import llama_native
from asyncengine.models.gguf import open_gguf
from asyncengine.models.loader import load_model

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
UNIFORM = {"blk.0.ffn_down.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K", "output.weight": "Q6_K",
           **{f"blk.1.attn_{p}.weight": "Q5_K" for p in ("q", "k", "v", "output")}}
MIXED = {"blk.0.attn_v.weight": "Q6_K", "output.weight": "Q6_K"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("kquant-gguf")
    tok = tiny_tokenizer()
    model = tiny_hf_model("llama", tok.get_vocab_size(), seed=3, **SHAPE)
    return {name: write_tiny_gguf(d / f"{name}.gguf", model, tok, qtype="Q4_K", tensor_qtypes=types)
            for name, types in (("uniform", UNIFORM), ("mixed", MIXED))}


def test_engine_matches_transformers_on_the_dequantized_weights(files):
    ref_model, reqs, outs = _generate_against_transformers(files["uniform"], seed=5, n=6)
    assert_greedy_parity(ref_model, reqs, outs)


def _generate_against_transformers(path, seed: int, n: int, check=None):
    """transformers' model on the file's dequantized weights, ``n`` random greedy requests, and the
    engine's outputs for them (fp32 activations); ``check(llm)`` runs on the engine first."""
    ref_model = _transformers_gguf_model(path)
    rng = random.Random(seed)
    vocab = ref_model.config.vocab_size
    reqs = [([rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))], rng.randint(1, 12)) for _ in range(n)]
    llm = LLM(str(path), dtype="float32", quantized_activations="fp32", skip_tokenizer_init=True)
    try:
        if check is not None:
            check(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                            [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs],
                            use_tqdm=False)
    finally:
        llm.shutdown()
    return ref_model, reqs, outs


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_native_step_is_token_exact_with_the_per_op_path(files, activations, monkeypatch):
    native, calls = run(str(files["uniform"]), monkeypatch, "1", activations)
    per_op, none = run(str(files["uniform"]), monkeypatch, "0", activations)
    assert none is None and calls and calls > 0
    assert native == per_op
    assert all(len(t) == n for t, (_, n) in zip(native, REQUESTS))


def _layers(path):
    model = load_model(EngineConfig(model=str(path), dtype="float32"), tokenizer=False).model
    return model, {name: layer for name, (layer, _) in model.checkpoint_layers().items()}


def test_projections_hold_the_files_blocks(files):
    """No dequantized copy: each projection's storage is its tensor's bytes in the file's format."""
    g = open_gguf(files["uniform"], tokenizer=False)
    types = {k.removeprefix("model."): v for k, v in g.tensor_types.items()}
    model, layers = _layers(files["uniform"])
    held = 0
    for name, layer in layers.items():
        ckpt = model.checkpoint_layers()[name][1]
        assert layer.quantized and {types[n] for n in ckpt} == {layer.qtype}, name
        assert not layer.packed  # K-quants keep the file's rows
        held += layer.weight_nbytes()
    file_bytes = sum(g._file.nbytes(t) for t in g._file.tensors if len(t.shape) == 2)
    assert held == file_bytes
    assert llama_native.native_step_reason(model) is None
    # one down projection, byte for byte the file's
    t = next(t for t in g._file.tensors if t.name == "blk.1.ffn_down.weight")
    assert torch.equal(layers["layers.1.mlp.down_proj"].qweight, g._file.torch_bytes(t).view(t.shape[0], -1))


def test_a_fused_layer_of_mixed_formats_becomes_q8_0(files):
    model, layers = _layers(files["mixed"])
    assert layers["layers.0.self_attn.qkv_proj"].qtype == "Q8_0"
    assert layers["layers.1.self_attn.qkv_proj"].qtype == "Q4_K"
    assert layers["lm_head"].qtype == "Q6_K"
    assert llama_native.native_step_reason(model) is None


def test_q5_0_blocks_become_q8_0_blocks_exactly():
    """llama-quantize's fallback for rows that are not whole super-blocks (Q5_0) reaches the layers
    as Q8_0 blocks holding the same values, so a K-quant file of a model with hidden 576 keeps its
    quantized kernels and its numbers (gguf-py decodes both)."""
    import gguf
    import numpy as np
    from gguf import quants

    from asyncengine.models.gguf.dequant import q5_0_as_q8_0

    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32) * 3
    q5 = quants.quantize(x, gguf.GGMLQuantizationType.Q5_0)
    q8 = q5_0_as_q8_0(torch.from_numpy(np.ascontiguousarray(q5)).view(8, -1)).numpy()
    assert q8.shape == (8, 8 * 34)
    assert np.array_equal(quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0),
                          quants.dequantize(q5, gguf.GGMLQuantizationType.Q5_0))


def test_a_q5_0_layer_runs_on_q8_0_blocks(tmp_path):
    """A Q5_0 tensor (the fallback) reaches its layer as Q8_0 blocks, and the engine generates what
    transformers generates from the file's dequantized weights."""
    tok = tiny_tokenizer()
    model = tiny_hf_model("llama", tok.get_vocab_size(), seed=3, **SHAPE)
    path = write_tiny_gguf(tmp_path / "q5.gguf", model, tok, qtype="Q4_K",
                           tensor_qtypes={f"blk.{i}.{p}.weight": "Q5_0" for i in (0, 1)
                                          for p in ("attn_q", "attn_k", "attn_v", "ffn_down")})

    def blocks_not_a_dequantized_copy(llm):
        qtypes = llm.engine.collective_rpc(_q5_layers_qtypes)[0]
        assert qtypes == ["Q8_0"] * 4, qtypes

    ref_model, reqs, outs = _generate_against_transformers(path, seed=7, n=4, check=blocks_not_a_dequantized_copy)
    assert_greedy_parity(ref_model, reqs, outs)


def _q5_layers_qtypes(worker) -> list:
    layers = worker.model.model.layers if hasattr(worker.model, "model") else worker.model.layers
    return [getattr(getattr(layers[i], m), p).qtype for i in (0, 1)
            for m, p in (("self_attn", "qkv_proj"), ("mlp", "down_proj"))]
