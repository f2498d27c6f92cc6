"""Mixture-of-experts GGUFs written by llama.cpp's own converter and llama-quantize (Mixtral as
``llama`` + experts, ``qwen2moe`` with its shared expert, ``qwen3moe``, ``olmoe``): the engine's
greedy tokens equal transformers' in fp32, on the original weights for F32 files and on the file's
dequantized values for F16/Q8_0/Q4_0/Q4_K_M (near-tie rule); every expert keeps the file's blocks
(no dequantized copy); the Hugging Face view splits the stacked expert tensors exactly."""
from __future__ import annotations

import random

import pytest
import torch
from gguf_moe_utils import MOE_ARCHS, convert_to_gguf, hf_model_with, llama_quantize, tiny_moe_model
from gguf_utils import tiny_tokenizer
from test_gguf import assert_greedy_parity

from asyncengine import LLM, SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.errors import ModelLoadError
from asyncengine.kernels.cpu import quant
from asyncengine.layers.linear import Linear
from asyncengine.layers.parallel import TPGroup
from asyncengine.models.gguf import load_gguf, open_gguf
from asyncengine.models.loader import load_model


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-moe")


@pytest.fixture(scope="module")
def gguf_file(tok, work):
    """(arch, qtype, hidden) -> (HF model, GGUF path), each converted (and quantized) once per module."""
    made = {}

    def get(arch: str, qtype: str, hidden: int = 64):
        if (arch, qtype, hidden) not in made:
            model = tiny_moe_model(arch, tok.get_vocab_size(), seed=2, hidden=hidden, inter=2 * hidden)
            d = work / f"{arch}-{hidden}"
            if qtype in ("F32", "F16"):
                path = convert_to_gguf(model, tok, d, qtype.lower())
            else:
                path = llama_quantize(get(arch, "F32", hidden)[1], d / f"{qtype}.gguf", qtype)
                model = get(arch, "F32", hidden)[0]
            made[arch, qtype, hidden] = (model, path)
        return made[arch, qtype, hidden]
    return get


def _requests(vocab: int, n: int = 4, seed: int = 5):
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(3, 30))], rng.randint(2, 10)) for _ in range(n)]


def _generate(path, reqs, activations: str = "fp32", logprobs: int | None = None):
    llm = LLM(str(path), dtype="float32", quantized_activations=activations, skip_tokenizer_init=True)
    try:
        return llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                            [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=logprobs) for _, m in reqs],
                            use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_f32_file_is_token_exact_with_transformers(arch, tok, gguf_file):
    model, path = gguf_file(arch, "F32")
    cfg = open_gguf(path, tokenizer=False).config
    assert cfg.model_type == model.config.model_type and cfg.num_experts_per_tok == 2
    assert cfg.norm_topk_prob == (arch in ("mixtral", "qwen3_moe"))
    # the Hugging Face view: each expert's tensor is the checkpoint's, exactly
    ref = hf_model_with(model, load_gguf(path, tokenizer=False).tensors)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name
    reqs = _requests(tok.get_vocab_size())
    assert_greedy_parity(model, reqs, _generate(path, reqs))


def _expert_layers(path):
    model = load_model(EngineConfig(model=str(path), dtype="float32"), tokenizer=False).model
    return {n: (layer, ckpt) for n, (layer, ckpt) in model.checkpoint_layers().items() if ".experts." in n}


@pytest.mark.parametrize("arch,qtype,hidden", [("mixtral", "F16", 64), ("qwen3_moe", "Q8_0", 64),
                                               ("mixtral", "Q4_0", 64), ("qwen2_moe", "Q4_K_M", 256)])
def test_quantized_experts_run_from_the_files_blocks(arch, qtype, hidden, tok, gguf_file):
    model, path = gguf_file(arch, qtype, hidden)
    g = open_gguf(path, tokenizer=False)
    types = {k.removeprefix("model."): v for k, v in g.tensor_types.items()}
    experts = _expert_layers(path)
    assert len(experts) == 2 * 4 * 2  # layers x experts x (gate_up, down)
    for name, (layer, ckpt) in experts.items():
        file_types = {types[n] for n in ckpt}
        if qtype == "F16":
            assert not layer.quantized and file_types == {"F16"}
        else:  # the file's own format, its bytes
            assert layer.quantized and file_types == {layer.qtype}, name
    if qtype == "Q4_K_M":  # llama-quantize's mix: some ffn_down_exps in Q6_K
        assert {layer.qtype for layer, _ in experts.values()} == {"Q4_K", "Q6_K"}
    ref = hf_model_with(model, load_gguf(path, tokenizer=False).tensors)  # the file's values, dequantized
    reqs = _requests(tok.get_vocab_size(), seed=7)
    assert_greedy_parity(ref, reqs, _generate(path, reqs))


def test_int8_activations_stay_close_to_the_fp32_path(tok, gguf_file):
    """The int8-activation kernels on quantized experts: each token they pick is, under the fp32
    path, within 1 nat of the best (quantized activations may swap a near tie, never pick noise)."""
    _, path = gguf_file("qwen3_moe", "Q8_0")
    reqs = [(p, 1) for p, _ in _requests(tok.get_vocab_size(), n=12, seed=9)]
    ref = _generate(path, reqs, "fp32", logprobs=20)
    got = _generate(path, reqs, "int8")
    for r, g in zip(ref, got):
        top = r.outputs[0].logprobs[0]
        best = max(x.logprob for x in top.values())
        t = g.outputs[0].token_ids[0]
        assert t in top and top[t].logprob > best - 1.0, (t, {k: v.logprob for k, v in top.items()})


def test_bad_expert_metadata_is_refused(gguf_file, tmp_path):
    import gguf

    _, src = gguf_file("olmoe", "F32")
    reader = gguf.GGUFReader(src)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(src.read_bytes())
    field = reader.fields["olmoe.expert_used_count"]
    data = bytearray(bad.read_bytes())
    off = int(field.parts[field.data[0]].ctypes.data - reader.data.ctypes.data)  # the value's bytes
    data[off:off + 4] = (9).to_bytes(4, "little")
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="expert_used_count 9"):
        open_gguf(bad, tokenizer=False)


def _expert_weights(model) -> dict[str, torch.Tensor]:
    """(global expert Linear name -> its blocks, dequantized) of a model's experts."""
    out = {}
    for name, layer in model.named_modules():
        if ".experts." in name and isinstance(layer, Linear):
            prefix, rest = name.split(".experts.")
            local, leaf = rest.split(".", 1)
            e = int(local) + model.get_submodule(prefix).shard.expert_start
            assert layer.quantized, name
            out[f"{prefix}.experts.{e}.{leaf}"] = quant.dequantize(layer.qweight, layer.qtype, layer.in_features,
                                                                    packed=layer.packed)
    return out


def _tp_slice(name: str, ref: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank`` of 2's columns of an expert (written out by hand)."""
    if "gate_up" in name:
        inter = ref.shape[0] // 2
        half = inter // 2
        return torch.cat([ref[:inter][rank * half:(rank + 1) * half], ref[inter:][rank * half:(rank + 1) * half]])
    half = ref.shape[1] // 2
    return ref[:, rank * half:(rank + 1) * half]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_and_expert_parallel_shards_hold_their_slice_of_the_blocks(expert_parallel, gguf_file):
    """In process: each of 2 ranks reads its experts whole (EP) or its half of every expert's
    columns (TP) straight from the file's blocks: that slice of the unsharded model's experts."""
    _, path = gguf_file("qwen3_moe", "Q8_0")
    config = EngineConfig(model=str(path), dtype="float32", skip_tokenizer_init=True)
    full = _expert_weights(load_model(config, tokenizer=False).model)
    seen = set()
    for rank in range(2):
        shard = load_model(config, tp=TPGroup(rank=rank, size=2, expert_parallel=expert_parallel),
                           tokenizer=False).model
        for name, w in _expert_weights(shard).items():
            ref = full[name] if expert_parallel else _tp_slice(name, full[name], rank)
            assert torch.equal(w, ref), (rank, name)
            seen.add(name)
    assert seen == set(full) and len(full) == 2 * 4 * 2


@pytest.mark.parametrize("arch,qtype,hidden,activations", [
    ("mixtral", "Q4_0", 64, "fp32"), ("qwen2_moe", "Q8_0", 64, "int8"), ("qwen3_moe", "Q4_K_M", 256, "int8")])
def test_native_decode_step_runs_moe_layers_token_exact_with_the_per_op_path(arch, qtype, hidden, activations,
                                                                                gguf_file, monkeypatch):
    """The native C step runs the MoE layers (kernels/cpu/moe.c, the per-op layer's own call), so
    a batch of 6 requests over 4 sequence slots decodes the per-op path's tokens, and the step
    really ran; the experts' load counts reach stats() from it."""
    from test_llama_native import _calls, _count_native

    _, path = gguf_file(arch, qtype, hidden)
    reqs = [(p, m + 10) for p, m in _requests(320, n=6, seed=13)]
    got = {}
    for native in ("1", "0"):
        monkeypatch.setenv("ASYNCENGINE_NATIVE_STEP", native)
        llm = LLM(str(path), dtype="float32", quantized_activations=activations, skip_tokenizer_init=True,
                  max_num_seqs=4)
        try:
            llm.engine.collective_rpc(_count_native)
            outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                                [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs],
                                use_tqdm=False)
            calls = llm.engine.collective_rpc(_calls)[0]
            routed = sum(llm.engine.stats()["moe_expert_tokens"])
        finally:
            llm.shutdown()
        got[native] = ([o.outputs[0].token_ids for o in outs], calls, routed)
    (native_ids, calls, routed), (per_op_ids, none, routed_per_op) = got["1"], got["0"]
    assert none is None and calls > sum(m for _, m in reqs) // 4
    assert native_ids == per_op_ids
    tokens = sum(len(p) + m - 1 for p, m in reqs)  # every prompt token and every decoded one but the last
    assert routed == routed_per_op == tokens * 2 * 2  # top 2 of each of 2 layers


@pytest.mark.parametrize("regime", [dict(max_num_batched_tokens=16, block_size=8),  # chunked prefill
                                    dict(num_kv_blocks=16, block_size=4)],  # preemption
                         ids=["chunked", "preempt"])
def test_native_moe_layers_in_the_regimes(regime, tok, gguf_file):
    """The C MoE layer on every step kind: prefill chunks of any length (the per-op layer), decodes
    (the native step), recomputation after preemption, and a prompt whose prefix is cached: 8
    requests, then one extending request 0's prompt, equal transformers' greedy tokens on the
    file's values (near-tie rule)."""
    model, path = gguf_file("qwen2_moe", "Q8_0")
    ref = hf_model_with(model, load_gguf(path, tokenizer=False).tensors)
    reqs = _requests(tok.get_vocab_size(), n=8, seed=17)
    reqs[0] = (reqs[0][0] * 2, reqs[0][1])  # long enough to fill whole blocks
    later = [(reqs[0][0] + [7, 8, 9], 6)]
    llm = LLM(str(path), dtype="float32", quantized_activations="fp32", skip_tokenizer_init=True, max_num_seqs=8,
              **regime)
    try:
        outs = [llm.generate([{"prompt_token_ids": p} for p, _ in batch],
                             [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in batch],
                             use_tqdm=False) for batch in (reqs, later)]
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert_greedy_parity(ref, reqs + later, outs[0] + outs[1])
    assert stats["prefix_cache_hit_rate"] > 0 and sum(stats["moe_expert_tokens"]) > 0
    if "num_kv_blocks" in regime:
        assert stats["num_preemptions"] > 0
