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
from asyncengine.models.gguf import load_gguf, open_gguf
from asyncengine.models.loader import load_model


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-moe")


def _requests(vocab: int, n: int = 4, seed: int = 5):
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(3, 30))], rng.randint(2, 10)) for _ in range(n)]


def _generate(path, reqs, activations: str = "fp32"):
    llm = LLM(str(path), dtype="float32", quantized_activations=activations, skip_tokenizer_init=True)
    try:
        return llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                            [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs],
                            use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_f32_file_is_token_exact_with_transformers(arch, tok, work):
    model = tiny_moe_model(arch, tok.get_vocab_size(), seed=1)
    path = convert_to_gguf(model, tok, work / arch, "f32")
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
def test_quantized_experts_run_from_the_files_blocks(arch, qtype, hidden, tok, work):
    model = tiny_moe_model(arch, tok.get_vocab_size(), seed=2, hidden=hidden, inter=2 * hidden)
    d = work / f"{arch}-{qtype}"
    f32 = convert_to_gguf(model, tok, d, "f16" if qtype == "F16" else "f32")
    path = f32 if qtype == "F16" else llama_quantize(f32, d / f"{qtype}.gguf", qtype)
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


def test_int8_activations_stay_close_to_the_fp32_path(tok, work):
    """The int8-activation kernels on quantized experts: most greedy tokens as the fp32 path's."""
    model = tiny_moe_model("qwen3_moe", tok.get_vocab_size(), seed=3)
    path = llama_quantize(convert_to_gguf(model, tok, work / "int8", "f32"), work / "int8" / "q8.gguf", "Q8_0")
    reqs = _requests(tok.get_vocab_size(), seed=9)
    a = [o.outputs[0].token_ids for o in _generate(path, reqs, "fp32")]
    b = [o.outputs[0].token_ids for o in _generate(path, reqs, "int8")]
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    assert same >= 0.8 * sum(len(s) for s in a), (a, b)


def test_bad_expert_metadata_is_refused(tok, work, tmp_path):
    import gguf

    model = tiny_moe_model("olmoe", tok.get_vocab_size())
    src = convert_to_gguf(model, tok, work / "bad", "f32")
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
