"""LoRA hooks on the native Llama/Qwen2 models inside a real engine: greedy token-exact against
transformers + PEFT merge_and_unload, per adapter, with three adapters cycling through two device
slots, driven from the worker: a wrapper sets every row of a step to the adapter under test, so the
hooks and the slots' LRU are tested apart from the engine's per-request routing (that is
test_multi_lora.py; the grouped apply over mixed rows: test_grouped.py)."""
import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.errors import ConfigError
from asyncengine.lora.hooks import LoRAModel
from lora_utils import ADAPTERS, make_adapter, merged_model_dir
from model_utils import compare, random_requests


def _attach(worker, adapters: dict[str, str]) -> None:
    lm = LoRAModel(worker.model, max_loras=2, max_lora_rank=16, max_cpu_loras=3)
    for i, (name, path) in enumerate(adapters.items(), start=1):
        lm.load(name, i, path)
    worker.lora_model, worker.lora_current = lm, 0
    inner = worker.model.forward

    def forward(input_ids, *args, **kwargs):
        lm.set_rows([worker.lora_current] * input_ids.shape[0])
        return inner(input_ids, *args, **kwargs)

    worker.model.forward = forward


def _select(worker, lora_id: int) -> None:
    worker.lora_current = lora_id


def _load_bad(worker, path: str) -> str:
    try:
        worker.lora_model.load("bad", 9, path)
    except ConfigError as e:
        return str(e)
    return ""


def _resident(worker) -> dict:
    return dict(worker.lora_model.slots.slot_of)


def _run(llm, requests):
    sp = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in requests]
    return [o.outputs[0].token_ids for o in llm.generate([list(p) for p, _ in requests], sp, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_adapters_token_exact_vs_peft_merged(arch, tiny_model_dir, hf_reference, tmp_path):
    base = tiny_model_dir(arch)
    adapters = {n: make_adapter(base, str(tmp_path / n), n, seed=k) for k, n in enumerate(ADAPTERS)}
    requests = random_requests(4, 512, seed=3, plen=(3, 30), olen=(4, 10))
    # no prefix caching: these requests carry no LoRARequest, so their blocks are not keyed by adapter
    llm = LLM(base, dtype="float32", enable_prefix_caching=False, max_num_seqs=4)
    llm.engine.collective_rpc(_attach, (adapters,))
    order = [1, 2, 3, 0, 1]  # three adapters through two slots: the LRU evicts and reloads
    for lora_id in order:
        llm.engine.collective_rpc(_select, (lora_id,))
        got = _run(llm, requests)
        if lora_id == 0:
            ref_dir = base
        else:
            name = list(adapters)[lora_id - 1]
            ref_dir = merged_model_dir(base, adapters[name], str(tmp_path / f"merged-{name}-{lora_id}"))
        refs = hf_reference(ref_dir, requests)
        counts = compare(got, refs)
        assert counts["exact"] + counts["near_tie"] == len(requests)
        assert counts["exact"] >= len(requests) - 1
        if lora_id:  # the adapter changes the tokens: the test would see a missing or wrong delta
            assert got != [r.tokens for r in hf_reference(base, requests)]
    assert set(llm.engine.collective_rpc(_resident)[0]) == {1, 3}
    # a hostile adapter is refused and the engine keeps serving
    err = llm.engine.collective_rpc(_load_bad, (str(tmp_path / "missing"),))[0]
    assert "no such folder" in err
    llm.engine.collective_rpc(_select, (0,))
    assert compare(_run(llm, requests), hf_reference(base, requests))["total"] == len(requests)
