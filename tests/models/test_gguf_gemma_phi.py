"""GGUF files of Gemma 2, Gemma 3 and Phi-3 (asyncengine.models.gguf: tensors.py names, arch_config.py).

Tiny random models are written by tests/gguf_utils.py as llama.cpp's converter writes them (Gemma's
norms as ``1 + weight``, Phi-3's fused tensors and LongRoPE factor tensors) and read back: the HF
view must be the original checkpoint's, and the engine must generate, greedy in fp32, what
transformers generates with the original config on the file's weights.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/: gguf_utils

from gguf_utils import tiny_hf_model, tiny_tokenizer, write_tiny_gguf  # noqa: E402
from test_gguf import assert_greedy_parity  # noqa: E402

from asyncengine.errors import ModelLoadError  # noqa: E402
from asyncengine.models.gguf import load_gguf, open_gguf  # noqa: E402
from asyncengine.models.gguf.arch_config import arch_kwargs  # noqa: E402

ARCHS = ("gemma2", "gemma3", "phi3")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer):
    return {arch: tiny_hf_model(arch, vocab_size=tokenizer.get_vocab_size()) for arch in ARCHS}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-gemma-phi")


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_is_the_hf_checkpoint(arch, models, tokenizer, gguf_dir):
    """load_gguf on an F32 file: the original config and tensors (Gemma's norms back to ``weight``,
    to the float32 rounding of ``(weight + 1) - 1``)."""
    model = models[arch]
    ckpt = load_gguf(write_tiny_gguf(gguf_dir / f"{arch}-f32.gguf", model, tokenizer), tokenizer=False)
    ours, theirs = ckpt.config.to_dict(), model.config.to_dict()
    skip = {"architectures", "_name_or_path", "transformers_version", "dtype"}
    assert {k: (ours.get(k), theirs.get(k)) for k in set(ours) | set(theirs)
            if k not in skip and ours.get(k) != theirs.get(k)} == {}
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not model.config.tie_word_embeddings}
    assert set(ckpt.tensors) == set(state)
    for name, tensor in state.items():
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            assert not torch.equal(ckpt.tensors[name] + 1, tensor)  # the file held 1 + weight: undone
            torch.testing.assert_close(ckpt.tensors[name], tensor, rtol=0, atol=1e-7)
        else:
            assert torch.equal(ckpt.tensors[name], tensor), name


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_weights_equal_the_checkpoints(arch, models, tokenizer, gguf_dir):
    """open_gguf (the engine's path) yields the tensors load_gguf (the HF view) makes, for Q8_0 too."""
    path = write_tiny_gguf(gguf_dir / f"{arch}-q8.gguf", models[arch], tokenizer, qtype="Q8_0")
    ckpt = load_gguf(path, tokenizer=False)
    opened = open_gguf(path, tokenizer=False)
    assert type(opened.config).__name__ == "GGUFModelConfig"
    assert opened.config.architectures == ckpt.config.architectures
    weights = dict(opened.weights())
    assert set(weights) == set(ckpt.tensors)
    for name, tensor in weights.items():
        assert torch.equal(tensor, ckpt.tensors[name]), name


@pytest.mark.parametrize("arch,qtype", [("gemma3", "F16"), ("gemma3", "Q8_0"), ("gemma2", "F32"),
                                        ("gemma2", "Q8_0"), ("phi3", "F32"), ("phi3", "Q8_0")])
def test_engine_greedy_matches_transformers(arch, qtype, models, tokenizer, gguf_dir):
    """The engine on the GGUF generates what transformers generates with the original config and the
    file's weights: prompts and outputs cross Gemma's 8-token window; Gemma 3 has 5 sliding layers
    and a global one, each with its own rope base; Gemma 2 soft-caps; Phi-3 rotates 3/4 of each head
    with LongRoPE's short factors."""
    from asyncengine import LLM, SamplingParams

    path = write_tiny_gguf(gguf_dir / f"{arch}-engine-{qtype}.gguf", models[arch], tokenizer, qtype=qtype)
    ref = tiny_hf_model(arch, vocab_size=tokenizer.get_vocab_size())
    result = ref.load_state_dict(load_gguf(path, tokenizer=False).tensors, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    ref.tie_weights()
    rng = random.Random(11)
    vocab = ref.config.vocab_size
    reqs = [([rng.randrange(3, vocab) for _ in range(rng.randint(3, 30))], rng.randint(1, 12)) for _ in range(6)]
    llm = LLM(str(path), dtype="float32", quantized_activations="fp32", max_model_len=256)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                        [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs],
                        use_tqdm=False)
    near_ties = assert_greedy_parity(ref.eval(), reqs, outs)
    print(f"{arch} {qtype}: {len(reqs) - near_ties}/{len(reqs)} exact, {near_ties} near-tie excuses")
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_files_keep_every_layer_in_blocks(arch, models, tokenizer, gguf_dir):
    """Every linear layer of a Q8_0 file runs on the block kernels, Phi-3's fused qkv/gate_up too
    (their one checkpoint tensor is cut into the parts by whole rows of blocks)."""
    from asyncengine.config import EngineConfig
    from asyncengine.layers.linear import Linear
    from asyncengine.models.loader import load_model

    path = write_tiny_gguf(gguf_dir / f"{arch}-q8.gguf", models[arch], tokenizer, qtype="Q8_0")
    model = load_model(EngineConfig(model=str(path), dtype="float32"), tokenizer=False).model
    formats = {name: m.qtype for name, m in model.named_modules() if isinstance(m, Linear)}
    assert set(formats.values()) == {"Q8_0"}, formats
    assert any("qkv_proj" in n for n in formats)


def test_a_missing_gemma_norm_is_refused(models, tokenizer, tmp_path):
    """A Gemma 3 file without a layer's post_ffw_norm is not a Gemma 3 model: a clear error."""
    path = write_tiny_gguf(tmp_path / "g.gguf", models["gemma3"], tokenizer)
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(tmp_path / "cut.gguf", "gemma3")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name != "blk.1.post_ffw_norm.weight":
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for load in (lambda p: load_gguf(p, tokenizer=False), lambda p: open_gguf(p, tokenizer=False)):
        with pytest.raises(ModelLoadError, match="post_feedforward_layernorm"):
            load(tmp_path / "cut.gguf")


def _kwargs(arch: str, metadata: dict, n_layers: int, hidden: int = 64, heads: int = 4) -> dict:
    kwargs = dict(num_hidden_layers=n_layers, hidden_size=hidden, num_attention_heads=heads, head_dim=16,
                  hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 1e6})

    def key(name, default=KeyError):
        return metadata.get(name, default)

    arch_kwargs(None, arch, key, kwargs, "x.gguf")
    return kwargs


def test_sliding_pattern_and_attention_scale_as_llama_cpp_reads_them():
    """Without a pattern key: Gemma 2 alternates, Gemma 3 has every 6th layer global; a period or a
    per-layer list overrides; no window key on Gemma 3: all global. The 27B models (by layer count)
    scale by hidden/heads, the others by head_dim."""
    s, f = "sliding_attention", "full_attention"
    assert _kwargs("gemma2", {}, 4)["layer_types"] == [s, f, s, f]
    assert _kwargs("gemma2", {}, 4)["sliding_window"] == 4096  # llama.cpp's default for Gemma 2
    g3 = _kwargs("gemma3", {"attention.sliding_window": 512}, 7)
    assert g3["layer_types"] == [s] * 5 + [f, s] and g3["sliding_window"] == 512
    assert g3["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert _kwargs("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": 3}, 3
                   )["layer_types"] == [s, s, f]
    assert _kwargs("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": [False, True]}, 2
                   )["layer_types"] == [f, s]
    assert _kwargs("gemma3", {}, 2)["layer_types"] == [f, f]
    assert _kwargs("gemma3", {}, 2)["query_pre_attn_scalar"] == 16
    assert _kwargs("gemma3", {}, 62, hidden=5376, heads=32)["query_pre_attn_scalar"] == 168
    assert _kwargs("gemma2", {}, 46, hidden=4608, heads=32)["query_pre_attn_scalar"] == 144
    with pytest.raises(ModelLoadError, match="sliding_window_pattern"):
        _kwargs("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True]}, 2)
