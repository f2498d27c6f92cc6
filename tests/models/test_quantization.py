"""Quantized weights end to end (docs/quantization.md): GGUF block formats kept in memory and run
by the CPU kernels, ``quantization="int8" | "int4"`` of a safetensors checkpoint, the fallback
without the C library, TP=2 with quantized shards, and that a quantized load never builds dense
weights.

The reference for every quantized engine is transformers, greedy fp32, on a dense checkpoint
holding exactly the dequantized weights (``load_gguf``'s tensors, or quantize -> dequantize of the
original): the kernels keep the block math exact, so outputs must be token-exact up to the
near-tie rule (a first divergence only where the reference's top-2 logit margin < 1e-4). That holds
for fp32 activations, so every test here pins ``ASYNCENGINE_QUANT_ACTIVATIONS=fp32`` (the int8 path
cannot be token-exact: tests/kernels/test_quant_kernels.py and tests/models/test_quant_accuracy.py hold it)."""
from __future__ import annotations

import os

import pytest
import torch
import transformers

from asyncengine import LLM, EngineConfig, SamplingParams
from asyncengine.cli import build_parser
from asyncengine.errors import ConfigError
from asyncengine.kernels.cpu import quant
from asyncengine.layers.linear import Linear, weight_nbytes
from asyncengine.models.loader import load_model
from gguf_utils import dense_reference_dir, tiny_hf_model, write_tiny_gguf
from model_utils import compare, random_requests

VOCAB = 320
REQUESTS = random_requests(8, VOCAB, seed=3, plen=(3, 40), olen=(4, 16))
COMMON = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=128, num_threads=1,
              freeze_gc_after_load=False)


@pytest.fixture(autouse=True)
def fp32_activations(monkeypatch):
    """In this process (the module attribute, read at import) and in worker processes (the env)."""
    monkeypatch.setattr(quant, "ACTIVATIONS", "fp32")
    monkeypatch.setenv("ASYNCENGINE_QUANT_ACTIVATIONS", "fp32")


def run(path: str, requests=REQUESTS, on_llm=None, **cfg) -> list[list[int]]:
    llm = LLM(path, **{**COMMON, **cfg})
    try:
        if on_llm is not None:
            on_llm(llm)
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in requests],
                            [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests],
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def formats(model) -> dict[str, str | None]:
    return {name: m.qtype for name, m in model.named_modules() if isinstance(m, Linear)}


@pytest.fixture(scope="module")
def models():
    return {"llama": tiny_hf_model("llama", VOCAB, seed=1),
            "qwen2": tiny_hf_model("qwen2", VOCAB, seed=2),  # QKV bias
            "llama-tied": tiny_hf_model("llama", VOCAB, seed=4, tie_word_embeddings=True)}


CASES = [("llama", "Q4_1"), ("qwen2", "Q8_0"), ("llama-tied", "Q4_0")]


@pytest.fixture(scope="module")
def ggufs(models, tmp_path_factory):
    d = tmp_path_factory.mktemp("quant-gguf")
    return {(a, q): str(write_tiny_gguf(d / f"{a}-{q}.gguf", models[a], None, qtype=q)) for a, q in CASES}


@pytest.fixture(scope="module")
def gguf_refs(models, ggufs, tmp_path_factory, hf_reference):
    """transformers' greedy outputs on the dequantized weights of each GGUF."""
    from asyncengine.models.gguf import load_gguf

    refs = {}
    for (arch, q), path in ggufs.items():
        ckpt = load_gguf(path, tokenizer=False)
        d = dense_reference_dir(tmp_path_factory.mktemp(f"ref-{arch}-{q}"), models[arch], ckpt.tensors)
        refs[(arch, q)] = hf_reference(d, REQUESTS)
    return refs


@pytest.mark.parametrize("arch,qtype", CASES)
def test_gguf_runs_quantized_and_matches_the_dequantized_reference(arch, qtype, ggufs, gguf_refs):
    path = ggufs[(arch, qtype)]
    model = load_model(EngineConfig(model=path, **COMMON), tokenizer=False).model
    assert set(formats(model).values()) == {qtype}  # every projection, the embedding and the head
    assert ("lm_head" in formats(model)) == (arch != "llama-tied")
    print(compare(run(path), gguf_refs[(arch, qtype)]))
    # quantization="none": today's dense path, the same reference
    assert set(formats(load_model(EngineConfig(model=path, quantization="none", **COMMON),
                                  tokenizer=False).model).values()) == {None}
    print(compare(run(path, quantization="none"), gguf_refs[(arch, qtype)]))


def test_quantized_load_never_builds_dense_weights(ggufs, monkeypatch):
    """Every block-format tensor goes from the file's bytes to the layer's blocks: nothing is
    dequantized (the spy), and the model holds what the file holds (+ nothing dense but norms)."""
    from asyncengine.models.gguf import dequant
    from asyncengine.models.gguf.reader import GGUFFile

    path = ggufs[("llama", "Q4_1")]
    decoded = []
    real = dequant.dequantize_torch
    monkeypatch.setattr(dequant, "dequantize_torch", lambda f, t, *a: decoded.append(t.name) or real(f, t, *a))
    model = load_model(EngineConfig(model=path, **COMMON), tokenizer=False).model
    assert decoded and all(name.endswith("norm.weight") for name in decoded), decoded
    f = GGUFFile(path)
    file_bytes = sum(f.nbytes(t) for t in f.tensors)
    norm_bytes = sum(f.nbytes(t) for t in f.tensors if t.name.endswith("norm.weight"))
    assert weight_nbytes(model) == file_bytes
    dense = [n for n, p in model.named_parameters() if p.dim() > 1]
    assert not dense and norm_bytes < 0.05 * file_bytes


@pytest.mark.parametrize("mode,qtype", [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_int8_int4_of_a_safetensors_checkpoint(mode, qtype, models, tmp_path, hf_reference):
    hf = models["qwen2"]
    src = tmp_path / "dense"
    hf.save_pretrained(src)
    model = load_model(EngineConfig(model=str(src), quantization=mode, **COMMON), tokenizer=False).model
    fmt = formats(model)
    assert fmt.pop("embed_tokens") == "Q8_0" and fmt.pop("lm_head") == "Q8_0"  # 8-bit in and out
    assert set(fmt.values()) == {qtype}
    # the reference: the same checkpoint with every weight through quantize -> dequantize
    weights = {}
    for name, t in hf.state_dict().items():
        leaf = name.removeprefix("model.")
        if t.dim() == 2:
            q = "Q8_0" if leaf.startswith(("embed_tokens", "lm_head")) else qtype
            t = quant.dequantize_torch(quant.quantize(t, q), q, t.shape[1])
        weights[name] = t
    refs = hf_reference(dense_reference_dir(tmp_path, hf, weights), REQUESTS)
    print(compare(run(str(src), quantization=mode), refs))
    # safetensors in its own format stays dense
    assert set(formats(load_model(EngineConfig(model=str(src), **COMMON), tokenizer=False).model).values()) == {None}


def test_without_the_kernels_weights_are_dequantized_at_load(ggufs, gguf_refs, kernels_off):
    path = ggufs[("llama", "Q4_1")]
    model = load_model(EngineConfig(model=path, **COMMON), tokenizer=False).model
    assert set(formats(model).values()) == {None}
    print(compare(run(path), gguf_refs[("llama", "Q4_1")]))


def test_tensor_parallel_2_quantized(ggufs, gguf_refs):
    """Two worker processes, each with its Q4_1 shard (row-parallel slices on block edges)."""
    path = ggufs[("llama", "Q4_1")]
    tp1 = weight_nbytes(load_model(EngineConfig(model=path, **COMMON), tokenizer=False).model)
    seen = {}
    outs = run(path, tensor_parallel_size=2, distributed_executor_backend="mp",
               on_llm=lambda llm: seen.update(stats=llm.engine.collective_rpc("runner_stats")))
    assert len(seen["stats"]) == 2
    for rank in seen["stats"]:  # each rank holds half of the quantized bytes
        assert abs(rank["weight_bytes"] / tp1 - 0.5) < 0.02, (rank["weight_bytes"], tp1)
    print(compare(outs, gguf_refs[("llama", "Q4_1")]))


def test_config_and_cli():
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineConfig(quantization="fp8")
    assert EngineConfig(quantization="int4").quantization == "int4"
    for cmd in ("chat", "serve"):
        assert build_parser().parse_args([cmd, "--quantization", "int8"]).quantization == "int8"
        assert build_parser().parse_args([cmd]).quantization is None
    assert "ASYNCENGINE_CPU_KERNELS" not in os.environ or os.environ["ASYNCENGINE_CPU_KERNELS"] != "0"
