"""Bad input: each mistake raises the package's own exception (InvalidRequestError, ModelLoadError,
ConfigError) with a message naming the problem, and an LLM that rejected a request keeps serving:
the next good generate() gives the same tokens as before and leaves every KV block free."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncengine import (LLM, AsyncEngineError, ConfigError, EngineConfig, InvalidRequestError, ModelLoadError,
                         SamplingParams)

MAX_MODEL_LEN = 128
VOCAB = 512
GOOD_PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60))]


def greedy(max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def baseline(llm) -> list[list[int]]:
    outs = llm.generate(GOOD_PROMPTS, greedy(), use_tqdm=False)
    check_clean(llm)
    return [o.outputs[0].token_ids for o in outs]


def check_clean(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished() and not eng.scheduler.running and not len(eng.scheduler.waiting)
    assert eng.kv.num_free_blocks == eng.num_blocks, "KV blocks leaked"
    assert not eng.kv.req_to_blocks
    eng.kv.pool.check_invariants()


def still_serving(llm: LLM, baseline) -> None:
    check_clean(llm)
    outs = llm.generate(GOOD_PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == baseline
    check_clean(llm)
    # the runner forgets finished requests at the next step: only this call's may still be there
    held = llm.engine.collective_rpc("runner_stats")[0]["request_ids"]
    assert set(held) <= {o.request_id for o in outs}


# ---------------------------------------------------------------------------- requests

BAD_REQUESTS = {
    "empty string": ("", None, "prompt is empty"),
    "empty token list": ([[]], None, "prompt is empty"),
    "empty token dict": ({"prompt_token_ids": []}, None, "prompt is empty"),
    "dict without prompt": ({"text": "hi"}, None, "needs 'prompt' or 'prompt_token_ids'"),
    "prompt too long": (list(range(3, 3 + 200)), None, "200 tokens, but max_model_len is 128"),
    "prompt exactly max_model_len": (list(range(3, 3 + MAX_MODEL_LEN)), None, "max_model_len is 128"),
    "token id = vocab size": ([5, 6, VOCAB], None, f"token id {VOCAB} is outside the vocabulary [0, {VOCAB})"),
    "negative token id": ([5, -1], None, "token id -1 is outside the vocabulary"),
    "float token id": ([5, 1.5], None, "must be integers"),
    "bool token id": ([True, 5], None, "must be integers"),
    "not a prompt": (3.5, None, "must be a string, a list of token ids or a dict, not float"),
    "not a prompt in a list": ([[5], None], None, "prompt #1: a prompt must be a string, a list of token ids or a "
                                                  "dict, not NoneType"),
    "params not SamplingParams": ([5, 6], {"max_tokens": 3}, "must be SamplingParams, not dict"),
    "stop token out of vocab": ([5, 6], greedy(stop_token_ids=[VOCAB + 7]), f"stop_token_ids: token id {VOCAB + 7}"),
    "logit_bias out of vocab": ([5, 6], greedy(logit_bias={VOCAB: 1.0}), "logit_bias: token id 512"),
    "allowed ids out of vocab": ([5, 6], greedy(allowed_token_ids=[1, -4]), "allowed_token_ids: token id -4"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_rejected_engine_keeps_serving(llm, baseline, name):
    prompt, params, fragment = BAD_REQUESTS[name]
    with pytest.raises(InvalidRequestError) as ei:
        llm.generate(prompt, params if params is not None else greedy(), use_tqdm=False)
    assert fragment in str(ei.value)
    if name != "not a prompt":  # the error says which prompt of the batch is bad
        assert "prompt #" in str(ei.value)
    still_serving(llm, baseline)


def test_one_bad_prompt_fails_the_batch_before_anything_runs(llm, baseline):
    steps = llm.engine.scheduler.stats.num_steps
    with pytest.raises(InvalidRequestError, match=r"prompt #2: .*outside the vocabulary"):
        llm.generate([[5, 6, 7], list(range(10, 40)), [5, 9999], [8, 9]], greedy(), use_tqdm=False)
    assert llm.engine.scheduler.stats.num_steps == steps  # validated up front: nothing was admitted
    still_serving(llm, baseline)


def test_mismatched_params_and_priorities(llm, baseline):
    with pytest.raises(InvalidRequestError, match="2 sampling params for 3 prompts"):
        llm.generate([[5], [6], [7]], [greedy(), greedy()], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="1 priorities for 2 prompts"):
        llm.generate([[5], [6]], greedy(), use_tqdm=False, priority=[0])
    still_serving(llm, baseline)


def test_longest_prompt_that_fits_gets_clipped_output(llm, baseline):
    """max_model_len - 1 prompt tokens is accepted; max_tokens is clipped to the room left."""
    (out,) = llm.generate([list(range(3, 3 + MAX_MODEL_LEN - 1))], greedy(50), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    (out,) = llm.generate([list(range(3, 3 + MAX_MODEL_LEN - 10))], greedy(50), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 10
    still_serving(llm, baseline)


@pytest.mark.parametrize("kw, fragment", [
    (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=-3), "max_tokens must be >= 1, got -3"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_k=-2), "top_k must be"),
    (dict(n=0), "n must be >= 1"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens (5) must be <= max_tokens (2)"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(stop=[""]), "stop strings must be non-empty"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
])
def test_bad_sampling_params(kw, fragment):
    with pytest.raises(InvalidRequestError) as ei:
        SamplingParams(**kw)
    assert fragment in str(ei.value) and str(ei.value).startswith("SamplingParams:")


def test_failure_mid_generate_leaves_engine_clean(llm, baseline, monkeypatch):
    """An exception inside the step loop (after requests were admitted) aborts them all, frees their
    blocks, and the next generate() works."""
    from worker_hooks import fail_after, restore_execute

    eng = llm.engine
    eng.collective_rpc(fail_after, (2, "injected fault"), {"once": True})
    try:
        with pytest.raises(RuntimeError, match="injected fault"):
            llm.generate([list(range(3, 40)), [7, 8, 9]] * 3, greedy(20), use_tqdm=False)
    finally:
        eng.collective_rpc(restore_execute)
    still_serving(llm, baseline)


# ---------------------------------------------------------------------------- checkpoints


@pytest.fixture
def ckpt_copy(tiny_llama_dir, tmp_path) -> Path:
    """A private copy of the tiny llama checkpoint (weights and config only) to break."""
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_llama_dir) / f, d / f)
    return d


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def load(d, **kw) -> LLM:
    return LLM(str(d), dtype="float32", num_kv_blocks=8, **kw)


def test_checkpoint_copy_loads(ckpt_copy):
    llm = load(ckpt_copy)  # the copy itself is fine (so the failures below are the edits')
    assert llm.tokenizer is None
    (out,) = llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_unknown_architecture(ckpt_copy):
    edit_config(ckpt_copy, architectures=["FooBarForCausalLM"])
    with pytest.raises(ModelLoadError) as ei:
        load(ckpt_copy)
    msg = str(ei.value)
    assert "FooBarForCausalLM" in msg and "not supported" in msg and "LlamaForCausalLM" in msg


def test_missing_architectures(ckpt_copy):
    edit_config(ckpt_copy, architectures=None)
    with pytest.raises(ModelLoadError, match=r"\(none given\) is not supported"):
        load(ckpt_copy)


def test_no_config_json(ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json") as ei:
        load(ckpt_copy)
    assert str(ckpt_copy) in str(ei.value)


def test_unreadable_config_json(ckpt_copy):
    (ckpt_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read config.json"):
        load(ckpt_copy)


def test_no_safetensors(ckpt_copy):
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors") as ei:
        load(ckpt_copy)
    assert str(ckpt_copy) in str(ei.value)


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError) as ei:
        load(missing)
    assert str(missing) in str(ei.value) and "No model at" in str(ei.value)


def test_plain_file_is_not_a_model(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match=r"weights.bin.* is neither a checkpoint folder nor a \.gguf file"):
        load(f)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors(ckpt_copy, damage):
    st = ckpt_copy / "model.safetensors"
    data = st.read_bytes()
    if damage == "truncated":
        st.write_bytes(data[:len(data) // 2])
    elif damage == "garbage":
        st.write_bytes(b"\x13\x37" * 4096)
    else:
        st.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="cannot read safetensors file") as ei:
        load(ckpt_copy)
    assert "model.safetensors" in str(ei.value)


def test_missing_tensor(ckpt_copy):
    st = ckpt_copy / "model.safetensors"
    tensors = load_file(str(st))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(st), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="checkpoint is missing 1 tensors") as ei:
        load(ckpt_copy)
    assert "layers.1.mlp.gate_up_proj" in str(ei.value)


def test_unexpected_tensor(ckpt_copy):
    st = ckpt_copy / "model.safetensors"
    tensors = load_file(str(st))
    tensors["model.layers.0.self_attn.mystery.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(st), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="mystery.weight"):
        load(ckpt_copy)


def test_config_does_not_match_weights(ckpt_copy):
    edit_config(ckpt_copy, intermediate_size=96)
    with pytest.raises(ModelLoadError, match="does not match LlamaForCausalLM.*checkpoint shape"):
        load(ckpt_copy)


def test_missing_shard(tiny_llama_dir, tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(ModelLoadError, match=f"shard {shard} named in the index is missing"):
        load(tmp_path)


# ---------------------------------------------------------------------------- engine configuration


@pytest.mark.parametrize("kw, fragment", [
    (dict(block_size=3), "block_size must be a positive power of two, got 3"),
    (dict(block_size=0), "block_size must be a positive power of two, got 0"),
    (dict(num_kv_blocks=1), "num_kv_blocks must be >= 2, got 1"),
    (dict(num_kv_blocks=None, kv_cache_bytes=0), "kv_cache_bytes must be > 0"),
    (dict(kv_cache_bytes=1 << 20), "not both"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1, got 0"),
    (dict(max_model_len=1), "max_model_len must be >= 2, got 1"),
    (dict(dtype="int8"), "dtype 'int8' is not one of"),
    (dict(dtype=torch.int32), "dtype torch.int32 is not supported"),
    (dict(device="tpu"), "device 'tpu'"),
    (dict(policy="lifo"), "policy must be 'fcfs' or 'priority', got 'lifo'"),
    (dict(enable_chunked_prefill=False, max_model_len=512, max_num_batched_tokens=256),
     "without chunked prefill, max_num_batched_tokens must be >= max_model_len"),
    (dict(num_threads=0), "num_threads must be >= 1"),
    (dict(max_queued_requests=0), "max_queued_requests must be >= 1"),
])
def test_bad_engine_config(tiny_llama_dir, kw, fragment):
    opts = dict(dtype="float32", num_kv_blocks=8)
    opts.update(kw)
    if opts.get("num_kv_blocks") is None:
        opts.pop("num_kv_blocks")
    dtype = opts.pop("dtype")
    with pytest.raises(ConfigError) as ei:
        LLM(tiny_llama_dir, dtype=dtype, **opts)
    assert fragment in str(ei.value)
    with pytest.raises(ConfigError):  # the same through EngineConfig directly
        EngineConfig(model=tiny_llama_dir, dtype=dtype, **opts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu(tiny_llama_dir):
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        LLM(tiny_llama_dir, dtype="float32", device="cuda")


def test_config_errors_found_at_load(tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"max_model_len=4096 exceeds what the model supports \(1024\)"):
        LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=8, max_model_len=4096)
    with pytest.raises(ConfigError, match="holds fewer than 2 blocks"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_bytes=100)


def test_errors_share_a_base_class():
    for cls in (InvalidRequestError, ModelLoadError, ConfigError):
        assert issubclass(cls, AsyncEngineError)
    assert issubclass(InvalidRequestError, ValueError) and issubclass(ConfigError, ValueError)
