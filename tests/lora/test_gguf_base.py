"""A PEFT adapter on a GGUF base model: an F32 GGUF of a tiny Llama (q/k rows permuted as
llama.cpp writes them, undone at load) serves an adapter made on the HF checkpoint it came from,
greedy token-exact against transformers + PEFT merge_and_unload, and the adapter changes the tokens.
A Q8_0 GGUF (its blocks kept: the quantized kernels, and the native C step with the adapter inside)
does the same against the merge onto its dequantized weights."""
import pytest
from asyncengine import LLM, LoRARequest, SamplingParams
from gguf_utils import dense_reference_dir, tiny_hf_model, write_tiny_gguf
from lora_utils import make_adapter, merged_model_dir
from model_utils import compare, random_requests


def test_adapter_on_a_gguf_base(tmp_path, hf_reference):
    hf = tiny_hf_model("llama", 320, seed=7)
    base_dir = str(tmp_path / "hf")
    hf.save_pretrained(base_dir)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf, None, qtype="F32")
    adapter = make_adapter(base_dir, str(tmp_path / "a16"), "a16", seed=1)
    merged = merged_model_dir(base_dir, adapter, str(tmp_path / "merged"))
    prompts = random_requests(4, 320, seed=9, plen=(5, 30), olen=(6, 10))
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_lora_rank=16,
              max_model_len=128)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in prompts]
    outs = llm.generate([list(p) for p, _ in prompts], params, use_tqdm=False,
                        lora_request=LoRARequest("a16", 1, adapter))
    mine = [o.outputs[0].token_ids for o in outs]
    counts = compare(mine, hf_reference(merged, prompts))
    assert counts["exact"] + counts["near_tie"] == 4
    base = [o.outputs[0].token_ids for o in llm.generate([list(p) for p, _ in prompts], params, use_tqdm=False)]
    assert base != mine


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_adapter_on_a_quantized_gguf_base(tmp_path, hf_reference, activations):
    from asyncengine.models.gguf import load_gguf

    hf = tiny_hf_model("llama", 320, seed=7)
    path = write_tiny_gguf(tmp_path / "tiny-q8.gguf", hf, None, qtype="Q8_0")
    base_dir = dense_reference_dir(tmp_path, hf, load_gguf(str(path), tokenizer=False).tensors)  # the file's values
    adapter = make_adapter(base_dir, str(tmp_path / "a16"), "a16", seed=1)
    merged = merged_model_dir(base_dir, adapter, str(tmp_path / "merged"))
    prompts = random_requests(4, 320, seed=9, plen=(5, 30), olen=(6, 10))
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_lora_rank=16,
              max_model_len=128, quantized_activations=activations)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in prompts]
    outs = llm.generate([list(p) for p, _ in prompts], params, use_tqdm=False,
                        lora_request=LoRARequest("a16", 1, adapter))
    mine = [o.outputs[0].token_ids for o in outs]
    if activations == "fp32":  # exact products of the file's values: transformers' tokens
        counts = compare(mine, hf_reference(merged, prompts))
        assert counts["exact"] + counts["near_tie"] == 4
    else:  # int8 activations round x: the same tokens as the fp32 kernels' run is not owed; the adapter acts
        base = [o.outputs[0].token_ids for o in llm.generate([list(p) for p, _ in prompts], params, use_tqdm=False)]
        assert base != mine
    assert llm.engine.collective_rpc(_native_lora_calls)[0] > 0  # the adapter ran inside the native C step


def _native_lora_calls(worker) -> int:
    step = worker.model.native_step
    return 0 if step is None else step.lora_calls
