"""update_weights in place (engine_core/weight_sync.py, worker/weight_update.py): after an update to
checkpoint B the engine's greedy tokens equal a fresh engine built on B, token-exact, for dense
safetensors weights and for weights quantized (int8, x8 layout) at load; a bad update raises
WeightUpdateError and the engine keeps answering with A's tokens; the prefix cache never serves
KV computed on the old weights; every output carries the weights version of its tokens."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from asyncengine import LLM, SamplingParams
from asyncengine.errors import WeightUpdateError
from model_utils import random_requests

REQUESTS = random_requests(6, 512, seed=5, plen=(3, 40), olen=(4, 12))
COMMON = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=256, num_threads=1,
              freeze_gc_after_load=False)


@pytest.fixture(scope="module")
def dirs(tiny_model_dir):
    """(A, B): two tiny llamas of one shape, different random weights."""
    return tiny_model_dir("llama", seed=0, tie_word_embeddings=False), tiny_model_dir("llama", seed=1)


def state_dict(path: str) -> dict[str, torch.Tensor]:
    return load_file(f"{path}/model.safetensors")


def greedy(llm: LLM, requests=REQUESTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in requests],
                        [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests],
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def fresh(path: str, **cfg) -> list[list[int]]:
    with LLM(path, **{**COMMON, **cfg}) as llm:
        return greedy(llm)


@pytest.mark.parametrize("how", ["state_dict", "named_pairs", "path"])
def test_update_equals_a_fresh_engine_on_the_new_weights(dirs, how):
    a, b = dirs
    want_b = fresh(b)
    with LLM(a, **COMMON) as llm:
        want_a = greedy(llm)
        assert want_a != want_b
        weights = {"state_dict": state_dict(b), "named_pairs": list(state_dict(b).items()), "path": b}[how]
        assert llm.update_weights(weights) == 1 == llm.weights_version
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in REQUESTS],
                            [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in REQUESTS],
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want_b
        assert all(o.weights_version == 1 and set(o.outputs[0].weights_versions) == {1} for o in outs)
        assert llm.update_weights(state_dict(a)) == 2
        assert greedy(llm) == want_a


def test_update_of_weights_quantized_at_load(dirs):
    """int8 blocks in the x8 layout: the dense update is quantized and repacked like a load."""
    a, b = dirs
    want_b = fresh(b, quantization="int8")
    with LLM(a, **COMMON, quantization="int8") as llm:
        from asyncengine.kernels.cpu import repack

        layer = llm.engine.executor.worker.model.layers[0].mlp.gate_up_proj
        assert layer.quantized and layer.packed == repack.can_pack(layer.out_features)
        before = greedy(llm)
        llm.update_weights(state_dict(b))
        assert greedy(llm) == want_b != before


@pytest.mark.parametrize("bad", ["wrong_name", "wrong_shape", "wrong_dtype", "missing", "nan", "not_tensors"])
def test_a_bad_update_raises_and_the_old_weights_serve(dirs, bad):
    a, b = dirs
    sd = state_dict(b)
    if bad == "wrong_name":
        sd["model.layers.0.mlp.gate_proj.weight_typo"] = sd.pop("model.layers.0.mlp.gate_proj.weight")
    elif bad == "wrong_shape":
        sd["model.layers.1.self_attn.o_proj.weight"] = sd["model.layers.1.self_attn.o_proj.weight"][:, :-1]
    elif bad == "wrong_dtype":
        sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int32)
    elif bad == "missing":
        del sd["model.layers.1.mlp.down_proj.weight"]
    elif bad == "nan":
        sd["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    else:
        sd = 42
    with LLM(a, **COMMON) as llm:
        want_a = greedy(llm)
        with pytest.raises(WeightUpdateError) as e:
            llm.update_weights(sd)
        if bad != "not_tensors":
            assert "unchanged" in str(e.value)
        assert llm.weights_version == 0
        assert greedy(llm) == want_a


def test_partial_update_changes_only_the_given_tensors(dirs):
    a, b = dirs
    with LLM(a, **COMMON) as llm:
        want_a = greedy(llm)
        sd_a = state_dict(a)
        with pytest.raises(WeightUpdateError, match="partial=True"):
            llm.update_weights({"model.norm.weight": sd_a["model.norm.weight"]})
        name = "model.layers.0.mlp.down_proj.weight"
        llm.update_weights({name: state_dict(b)[name]}, partial=True)
        assert greedy(llm) != want_a
        llm.update_weights({name: sd_a[name]}, partial=True)
        assert greedy(llm) == want_a


def test_the_prefix_cache_never_serves_kv_of_the_old_weights(dirs):
    a, b = dirs
    prompt = list(range(10, 60))  # three full blocks of 16
    req = [(prompt, 6)]
    with LLM(b, **COMMON) as ref:
        want_b = greedy(ref, req)
    with LLM(a, **COMMON) as llm:
        greedy(llm, req)
        greedy(llm, req)
        assert llm.engine.kv.prefix_hits > 0  # the prompt is cached
        hits = llm.engine.kv.prefix_hits
        llm.update_weights(b)
        assert greedy(llm, req) == want_b
        assert llm.engine.kv.prefix_hits == hits  # recomputed, not served from A's blocks
        assert greedy(llm, req) == want_b
        assert llm.engine.kv.prefix_hits > hits  # and cached again, under B
        llm.reset_prefix_cache()
        hits = llm.engine.kv.prefix_hits
        greedy(llm, req)
        assert llm.engine.kv.prefix_hits == hits
