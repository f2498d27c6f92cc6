"""The Transformers backend (models/transformers_backend.py): transformers' model code with our
paged attention, greedy token-exact against transformers in fp32 (near-tie rule) on architectures
we have no native model for (OLMo 2, GPT-NeoX, Granite), in the cache regimes of test_parity.py
(generous, chunked prefill on a small budget, preemption), with prefix-cache hits and n > 1; on a
tiny Llama it gives the native model's tokens; what it cannot run is refused with the reason."""
from __future__ import annotations

import random
import re
import types

import pytest
import transformers

from asyncengine import LLM, SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.errors import ConfigError, ModelLoadError
from asyncengine.models.model_info import load_model_info, read_hf_config
from asyncengine.models.registry import TRANSFORMERS_BACKEND, check_architecture
from asyncengine.models.transformers_backend import as_transformers_config, check_supported
from model_utils import compare
from test_parity import REGIMES, check_no_leak, record, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# every regime on OLMo 2 and GPT-NeoX (parallel residual, partial rotary, legacy head name); the
# chunked one on Granite (attention multiplier: a scale other than 1/sqrt(head_dim); logit scaling)
CASES = [("olmo2", r) for r in REGIMES] + [("gpt_neox", r) for r in REGIMES] + [("granite", "chunked")]


@pytest.mark.parametrize("arch,regime", CASES)
def test_parity(arch, regime, tiny_model_dir, tiny_reference):
    requests, refs = tiny_reference(arch)
    llm = LLM(tiny_model_dir(arch), dtype="float32", **REGIMES[regime])
    assert "Transformers backend" in llm.engine.kernels
    counts = record(f"{arch}/transformers/{regime}", compare(run(llm, requests), refs))
    assert counts["exact"] + counts["near_tie"] == len(requests)
    if regime == "preempt":
        assert llm.engine.stats()["num_preemptions"] > 0


def test_prefix_hits_and_n(tiny_model_dir, hf_reference):
    d = tiny_model_dir("olmo2")
    rng = random.Random(3)
    prefix = [rng.randrange(3, 512) for _ in range(29)]
    requests = [(prefix + [rng.randrange(3, 512) for _ in range(rng.randint(1, 12))], rng.randint(2, 10))
                for _ in range(6)]
    refs = hf_reference(d, requests)
    llm = LLM(d, dtype="float32", num_kv_blocks=96, block_size=8, max_num_batched_tokens=32,
              enable_prefix_caching=True)
    first = run(llm, requests)
    assert run(llm, requests[::-1])[::-1] == first
    assert llm.engine.stats()["prefix_cache_hits"] >= 6 * 24
    compare(first, refs)
    outs = llm.generate([list(p) for p, _ in requests[:2]],
                        [SamplingParams(n=2, max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in requests[:2]],
                        use_tqdm=False)
    for out, ref in zip(outs, refs):
        assert len(out.outputs) == 2
        compare([c.token_ids for c in out.outputs], [ref, ref])
    check_no_leak(llm)


def test_llama_through_transformers_equals_native(tiny_model_dir, tiny_reference):
    requests, refs = tiny_reference("llama")
    d = tiny_model_dir("llama")
    tokens = {}
    for impl in ("native", "transformers"):
        llm = LLM(d, dtype="float32", model_impl=impl, **REGIMES["chunked"])
        assert ("Transformers backend" in llm.engine.kernels) == (impl == "transformers")
        tokens[impl] = run(llm, requests)
        compare(tokens[impl], refs)
    assert tokens["transformers"] == tokens["native"]


def test_config_from_a_plain_namespace(tiny_model_dir):
    """A worker process gets the config as a dict: it becomes the same transformers config."""
    cfg = read_hf_config(tiny_model_dir("gpt_neox"))
    again = as_transformers_config(types.SimpleNamespace(**cfg.to_dict()))
    drop = {"_name_or_path"}
    assert type(again) is type(cfg)
    assert {k: v for k, v in again.to_dict().items() if k not in drop} == \
        {k: v for k, v in cfg.to_dict().items() if k not in drop}


def test_refusals(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="model_impl"):
        EngineConfig(model="x", model_impl="vllm")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="GGUF files load into our native models only"):
        load_model_info(EngineConfig(model=str(gguf), model_impl="transformers"))
    olmo = read_hf_config(tiny_model_dir("olmo2"))
    assert check_architecture(olmo) == TRANSFORMERS_BACKEND
    with pytest.raises(ModelLoadError, match="not supported natively"):
        check_architecture(olmo, "native")
    # Olmo 2's plan gathers q/k/v outputs (its q/k norms span every head): a style we do not apply
    with pytest.raises(ConfigError, match="colwise_gather_output"):
        LLM(tiny_model_dir("olmo2"), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp")
    with pytest.raises(ConfigError, match="base_model_tp_plan"):
        check_supported(transformers.BitNetConfig(architectures=["BitNetForCausalLM"]), tp_size=2)
    with pytest.raises(ConfigError, match="causal language models"):
        check_supported(transformers.BertConfig(architectures=["BertForMaskedLM"]))
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        check_supported(olmo, pp_size=2)
    # StableLM's attention is not declared to go through the attention interface
    stablelm = transformers.StableLmConfig(architectures=["StableLmForCausalLM"])
    with pytest.raises(ConfigError, match="attention interface"):
        check_architecture(stablelm, "transformers")
    with pytest.raises(ModelLoadError, match="attention interface"):
        check_architecture(stablelm)
    t5 = transformers.T5Config(architectures=["T5ForConditionalGeneration"])
    with pytest.raises(ConfigError, match="encoder-decoder"):
        check_architecture(t5, "transformers")
    remote = types.SimpleNamespace(architectures=["MyOwnForCausalLM"], auto_map={"AutoModel": "x.y"},
                                   model_type="llama")
    with pytest.raises(ConfigError, match="remote code"):
        check_architecture(remote, "transformers")


def test_tensor_parallel_from_the_models_plan(tiny_model_dir, tiny_reference):
    """TP=2 (worker processes, gloo) splits by the model's base_model_tp_plan: Granite's q/k/v and
    gate/up by rows, o/down by columns with one all-reduce each; the tokens equal transformers'."""
    requests, refs = tiny_reference("granite")
    llm = LLM(tiny_model_dir("granite"), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp",
              num_threads=1, **REGIMES["chunked"])
    try:
        counts = compare(run(llm, requests), refs)
        assert counts["exact"] + counts["near_tie"] == len(requests)
    finally:
        llm.shutdown()


def test_structured_outputs(tiny_model_dir):
    """Grammar masks apply to the Transformers backend's logits as to a native model's."""
    from asyncengine.structured import StructuredOutputsParams as SO

    llm = LLM(tiny_model_dir("llama"), dtype="float32", model_impl="transformers", num_kv_blocks=64, block_size=8)
    choices = ["yes", "no", "maybe"]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, structured_outputs=SO(choice=choices))
              for s in range(3)]
    params.append(SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=SO(regex=r"[0-9]{3}-[a-c]{2}")))
    outs = llm.generate(["The answer is"] * 4, params, use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outs[:3])
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", outs[3].outputs[0].text)
    check_no_leak(llm)
