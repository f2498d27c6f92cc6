"""The first five minutes, asserted without timing: what a start imports, builds and touches.

* ``asyncengine --help`` / ``--version`` import no torch, nor does checking an EngineConfig, nor
  the front end of an engine whose core runs in its own process;
* a GGUF load builds no transformers object (transformers is not even imported), no
  torch._dynamo and no sympy (torch's meta-tensor reference code imports it: 0.65 s), no ``gguf``
  package (0.12 s: our own ggml type table and torch decoding instead), and the tokenizer it builds
  equals transformers' on the same file;
* the runtime weight cache maps what it wrote, with the same outputs;
* the CLI checks its input and port before loading a model; piped /reset and /exit work; a cut
  answer says so;
* one set of sampling defaults.
(The KV cache's lazily touched memory is pinned in test_kv_sizing.py.)
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/: gguf_utils

from gguf_utils import CHATML_TEMPLATE, tiny_hf_model, tiny_tokenizer, write_tiny_gguf  # noqa: E402

from asyncengine.sampling_params import SamplingParams  # noqa: E402


ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


def run_py(code: str, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**ENV, **env})


def run_cli(*args: str, input: str | None = None, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncengine", *args], capture_output=True, text=True,
                          input=input, timeout=timeout, env={**ENV, **env})


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tok = tiny_tokenizer()
    model = tiny_hf_model("llama", vocab_size=tok.get_vocab_size())
    return str(write_tiny_gguf(tmp_path_factory.mktemp("cold") / "tiny.gguf", model, tok, qtype="Q8_0"))


def test_help_and_version_do_not_import_torch():
    """Nor asyncio: it was half of --help's CPU time."""
    code = ("import sys\nfrom asyncengine.cli import main\n"
            "for argv in (['--help'], ['chat', '--help'], ['serve', '--help'], ['--version']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, e.code\n"
            "heavy = [m for m in ('torch', 'transformers', 'numpy', 'asyncio') if m in sys.modules]\n"
            "print('HEAVY', heavy)\n")
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout, r.stdout[-500:]
    assert "--repetition-penalty" in r.stdout and "--kv-cache-memory" in r.stdout
    assert "asyncengine 0.1.0" in r.stdout


def test_gguf_load_builds_no_transformers_objects(tiny_gguf):
    code = (f"import sys\nfrom asyncengine import LLM, SamplingParams\n"
            f"llm = LLM({tiny_gguf!r}, dtype='float32', num_kv_blocks=64)\n"
            f"out = llm.chat([{{'role': 'user', 'content': 'hi'}}], SamplingParams(max_tokens=4, temperature=0),"
            f" use_tqdm=False)\n"
            f"print('TOKENS', len(out[0].outputs[0].token_ids))\n"
            f"print('LOADED', sorted(m for m in ('transformers', 'torch._dynamo', 'sympy', 'gguf') if m in sys.modules))\n"
            f"print('TOKENIZER', type(llm.get_tokenizer()).__name__, type(llm.engine.model_info.hf_config).__name__)\n")
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    assert "TOKENS 4" in r.stdout
    assert "LOADED []" in r.stdout, r.stdout
    assert "TOKENIZER ChatTokenizer GGUFModelConfig" in r.stdout


def test_config_is_checked_without_torch():
    """EngineConfig spells out its errors at construction without importing torch (a front end
    whose engine core runs elsewhere never imports it); torch comes with the first resolved field."""
    code = ("import sys\nfrom asyncengine import EngineConfig, ConfigError\n"
            "EngineConfig(dtype='bf16', device='cuda:1', attention_backend='cpu')\n"
            "for bad in (dict(dtype='fp8'), dict(device='tpu'), dict(device='cuda0'), dict(attention_backend='flash'),\n"
            "            dict(device='cuda', quantization='int8')):\n"
            "    try:\n        EngineConfig(**bad)\n    except ConfigError as e:\n        print('REFUSED', e)\n"
            "print('TORCH', 'torch' in sys.modules)\n"
            "c = EngineConfig(device='cpu', dtype='float32')\n"
            "print('RESOLVED', c.torch_dtype, c.torch_device, 'torch' in sys.modules)\n")
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("REFUSED") == 5, r.stdout
    assert "TORCH False" in r.stdout
    assert "RESOLVED torch.float32 cpu True" in r.stdout


def test_process_core_front_end_imports_no_torch(tiny_gguf):
    """With engine_core_process the front end reads the model (config, tokenizer) without torch,
    after the core process was launched: the core imports torch meanwhile (engine/core_client.py)."""
    code = (f"import asyncio, multiprocessing, sys\n"
            f"from asyncengine import AsyncLLMEngine, EngineConfig, SamplingParams\n"
            f"import asyncengine.models.model_info as mi\n"
            f"real = mi.load_model_info\n"
            f"def spy(config):\n"
            f"    print('CORES_WHEN_READING', len(multiprocessing.active_children()))\n"
            f"    return real(config)\n"
            f"mi.load_model_info = spy\n"
            f"async def main():\n"
            f"    eng = AsyncLLMEngine(EngineConfig(model={tiny_gguf!r}, dtype='float32', num_kv_blocks=64,\n"
            f"                                      engine_core_process=True))\n"
            f"    async with eng:\n"
            f"        out = await eng.complete([{{'role': 'user', 'content': 'hi'}}],\n"
            f"                                 SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))\n"
            f"    print('TOKENS', len(out.outputs[0].token_ids), eng.dtype)\n"
            f"    print('HEAVY', [m for m in ('torch', 'transformers') if m in sys.modules])\n"
            f"if __name__ == '__main__':\n"
            f"    asyncio.run(main())\n")
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    assert "CORES_WHEN_READING 1" in r.stdout, r.stdout
    assert "TOKENS 4 float32" in r.stdout, r.stdout
    assert "HEAVY []" in r.stdout, r.stdout


TEXTS = ["Hello world! Hello there, how are you today?", "Numbers 2024 and 3.14159, digits 1234567890.",
         "  leading spaces\n\ttabs and newlines\n\n", "unicode: héllo wörld — ✓ 😀", "<|im_start|>user\nhi<|im_end|>\n"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}]


def check_same_tokenizer(ours, ref):
    for t in TEXTS:
        assert ours.encode(t) == ref.encode(t), t
        ids = ref.encode(t)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    for gen in (True, False):
        assert ours.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=False) == \
            ref.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=False)
        want = ref.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=True)
        assert ours.apply_chat_template(CHAT, add_generation_prompt=gen) == list(getattr(want, "input_ids", want))
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (ref.eos_token_id, ref.bos_token_id, len(ref))


def test_fast_tokenizer_equals_transformers_on_a_tiny_gguf(tiny_gguf):
    from asyncengine.models.gguf import load_gguf, open_gguf

    ours = open_gguf(tiny_gguf)
    ref = load_gguf(tiny_gguf)  # transformers' GGUF tokenizer conversion
    assert type(ours.tokenizer).__name__ == "ChatTokenizer"
    assert ours.tokenizer.chat_template == CHATML_TEMPLATE
    check_same_tokenizer(ours.tokenizer, ref.tokenizer)
    assert ours.eos_token_ids == ref.eos_token_ids
    assert {k: v for k, v in vars(ours.config).items() if k != "model_type"} == \
        {k: getattr(ref.config, k) for k in vars(ours.config) if k != "model_type"}
    import torch

    got = dict(ours.weights(torch.float32))
    assert set(got) == set(ref.tensors)
    for name, t in ref.tensors.items():
        assert torch.equal(got[name], t), name


@pytest.mark.smollm2
def test_fast_tokenizer_equals_transformers_on_smollm2():
    from asyncengine.models.default_model import ensure_default_model
    from asyncengine.models.gguf import open_gguf
    from asyncengine.models.gguf.vocab import build_tokenizer

    path = ensure_default_model()
    ours = open_gguf(path)
    check_same_tokenizer(ours.tokenizer, build_tokenizer(path, ours.metadata))


@pytest.mark.parametrize("quantization", [None, "none"])  # the file's Q8_0 blocks; dequantized to fp32
def test_weight_cache_maps_what_it_wrote(tiny_gguf, tmp_path, monkeypatch, quantization):
    import torch

    from asyncengine import LLM
    from asyncengine.models import weight_cache

    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path))
    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", num_kv_blocks=32, quantization=quantization)
    first = LLM(tiny_gguf, **kw)
    files = list((tmp_path / "weights").glob("*.bin"))
    assert len(files) == 1
    a = first.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    second = LLM(tiny_gguf, **kw)
    from worker_hooks import runner_of

    first_model, second_model = (llm.engine.collective_rpc(runner_of)[0].model for llm in (first, second))
    layer = second_model.layers[0].self_attn.qkv_proj
    assert layer.quantized == (quantization is None)
    w = layer.qweight if layer.quantized else layer.weight
    assert not w.is_meta and w.untyped_storage().nbytes() == files[0].stat().st_size  # a view of the file
    b = second.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
    s1, s2 = first_model.state_dict(), second_model.state_dict()
    assert list(s1) == list(s2)
    for name in s1:
        assert torch.equal(s1[name], s2[name]), name
    # the other storage is another entry, never this one's blocks
    other = LLM(tiny_gguf, **{**kw, "quantization": "none" if quantization is None else None})
    assert len(list((tmp_path / "weights").glob("*.bin"))) == 2
    other.shutdown()
    # a corrupt entry is ignored, not trusted
    files[0].write_bytes(files[0].read_bytes()[:100])
    third = LLM(tiny_gguf, **kw)
    assert third.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids == a
    for llm in (first, second, third):
        llm.shutdown()


def test_weight_cache_deletes_what_no_key_reaches(tiny_gguf, tmp_path, monkeypatch):
    """Writing an entry deletes the entries of a GGUF that changed, of an older format, and data
    files left without an index by a crash (not one being written: those are recent); the entries
    of another storage of the same unchanged file stay."""
    import shutil
    import time

    from asyncengine import LLM
    from asyncengine.models import weight_cache

    monkeypatch.setenv("ASYNCENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    model = tmp_path / "m.gguf"
    shutil.copy(tiny_gguf, model)
    folder = tmp_path / "cache" / "weights"
    kw = dict(dtype="float32", num_kv_blocks=16)

    def entries():
        return sorted(p.name for p in folder.glob("*.bin"))

    LLM(str(model), **kw).shutdown()
    LLM(str(model), quantization="none", **kw).shutdown()
    both = entries()
    assert len(both) == 2  # two storages of one file: both reachable
    (folder / "old.bin").write_bytes(b"x")
    (folder / "old.json").write_text('{"nbytes": 1, "tensors": {}}')  # written before "format"
    (folder / "crashed.bin").write_bytes(b"x")
    os.utime(folder / "crashed.bin", (time.time() - 3600,) * 2)
    (folder / "writing.bin").write_bytes(b"x")  # another process's, its index not written yet
    LLM(str(model), **kw).shutdown()  # a hit: nothing written, nothing deleted
    assert entries() == sorted(both + ["crashed.bin", "old.bin", "writing.bin"])
    os.utime(model, (time.time() + 10,) * 2)  # the GGUF changed: its two entries are unreachable
    LLM(str(model), **kw).shutdown()
    now = entries()
    assert len(now) == 2 and "writing.bin" in now and not set(now) & set(both), now


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_rejects_bad_input_before_loading(tmp_path):
    missing = str(tmp_path / "does-not-exist.gguf")  # would fail at load: these must fail first
    r = run_cli("chat", missing, input="\n\n")
    assert r.returncode == 2 and "stdin had no question" in r.stderr and "loading" not in r.stderr
    r = run_cli("chat", missing, "--prompt", "   ")
    assert r.returncode == 2 and "--prompt is empty" in r.stderr
    r = run_cli("chat", missing, "--prompt", "hi", "--kv-cache-memory", "lots")
    assert r.returncode == 2 and "not a size" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("serve", missing, "--port", str(port))
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr and "loading" not in r.stderr


def test_cli_piped_reset_exit_and_cut_answers(tiny_gguf):
    r = run_cli("chat", tiny_gguf, "--max-tokens", "3", "--temperature", "0", "--dtype", "float32",
                input="first question\n/reset\nsecond question\n/exit\nnever asked\n")
    assert r.returncode == 0, r.stderr
    assert "> first question" in r.stderr and "> second question" in r.stderr
    assert "never asked" not in r.stderr
    assert r.stderr.count("(conversation cleared)") == 1
    assert r.stderr.count("cut at --max-tokens 3") == 2
    assert "asyncengine: loading" in r.stderr and "ready" in r.stderr


# ----------------------------------------------------------------------------------------- defaults


def test_generation_config_reaches_the_engine(tiny_model_dir, tmp_path):
    import json
    import shutil

    from asyncengine import LLM

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), d)
    gc = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").exists() else {}
    gc.update(temperature=0.42, top_k=7)
    (d / "generation_config.json").write_text(json.dumps(gc))
    llm = LLM(str(d), dtype="float32", num_kv_blocks=16)
    assert llm.engine.model_info.generation_config["temperature"] == 0.42
    from asyncengine.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(llm.config, core=llm.engine)
    p = engine.default_sampling_params
    assert (p.temperature, p.top_k, p.max_tokens) == (0.42, 7, None)
