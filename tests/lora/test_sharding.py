"""LoRA under tensor parallelism: each rank's adapter slice is the base weights' slice (checked
piece by piece on TP=2 models built without processes), and a TP=2 engine (mp executor) serving two
adapters mixed with the base gives TP=1's tokens and transformers + PEFT merge_and_unload's."""
import pytest
import torch
import transformers

from asyncengine import LLM, LoRARequest, SamplingParams
from asyncengine.errors import ConfigError
from asyncengine.layers.parallel import PPGroup, TPGroup
from asyncengine.lora.hooks import LoRAModel
from asyncengine.lora.peft_adapter import load_peft_adapter
from asyncengine.lora.sharding import full_shapes
from asyncengine.models.llama import LlamaForCausalLM
from lora_utils import make_adapter, merged_model_dir
from model_utils import compare, random_requests

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("loras-tp")
    adapters = {n: make_adapter(base, str(root / n), n, seed=k + 7) for k, n in enumerate(("a4", "a16"))}
    merged = {n: merged_model_dir(base, p, str(root / f"merged-{n}")) for n, p in adapters.items()}
    return base, adapters, merged


def _model(base: str, tp: TPGroup, pp: PPGroup | None = None) -> LlamaForCausalLM:
    cfg = transformers.AutoConfig.from_pretrained(base)
    return LlamaForCausalLM(cfg, 64, tp) if pp is None else LlamaForCausalLM(cfg, 64, tp, pp)


def test_rank_slices_rebuild_the_adapter(setup):
    base, adapters, _ = setup
    whole_model = _model(base, TPGroup())
    whole = load_peft_adapter("a16", 1, adapters["a16"], full_shapes(whole_model), 16).weights
    parts = []
    for rank in range(2):
        lm = LoRAModel(_model(base, TPGroup(rank=rank, size=2)), max_loras=1, max_lora_rank=16)
        parts.append(lm.load("a16", 1, adapters["a16"]).weights)
        assert lm.slots.activate({1}) == {1: 0}  # the slices fit this rank's slots
    assert set(parts[0]) == set(whole) and len(whole) == 7 * len(whole_model.layers)
    for key, (a, b) in whole.items():
        (a0, b0), (a1, b1) = parts[0][key], parts[1][key]
        if key[1] in COLUMN:  # output rows split, A whole
            assert torch.equal(a0, a) and torch.equal(a1, a) and torch.equal(torch.cat([b0, b1]), b)
        else:  # o/down: input columns split, B whole
            assert torch.equal(b0, b) and torch.equal(b1, b) and torch.equal(torch.cat([a0, a1], 1), a)


def test_mismatched_adapter_and_pipeline_refused(setup, tiny_model_dir, tmp_path):
    base, _, _ = setup
    other = make_adapter(tiny_model_dir("llama", num_key_value_heads=4), str(tmp_path / "other"), "a4")
    lm = LoRAModel(_model(base, TPGroup(rank=1, size=2)), max_loras=1, max_lora_rank=16)
    with pytest.raises(ConfigError, match="another base model"):
        lm.load("other", 1, other)  # checked whole, so the kv shape mismatch shows on every rank
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        LoRAModel(_model(base, TPGroup(), PPGroup(rank=0, size=2, next_rank=1)), max_loras=1, max_lora_rank=16)


def _generate(base: str, tp: int, reqs) -> list[list[int]]:
    kw = dict(distributed_executor_backend="mp", num_threads=1) if tp > 1 else {}
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=12,
              tensor_parallel_size=tp, **kw)
    try:
        outs = llm.generate([list(p) for p, _, _ in reqs],
                            [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m, _ in reqs],
                            use_tqdm=False, lora_request=[lr for _, _, lr in reqs])
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def test_tp2_mixed_adapters_match_tp1_and_peft(setup, hf_reference):
    base, adapters, merged = setup
    prompts = random_requests(4, 512, seed=11, plen=(12, 30), olen=(5, 9))
    loras = [None] + [LoRARequest(n, i, p) for i, (n, p) in enumerate(adapters.items(), start=1)]
    reqs = [(p, m, lr) for lr in loras for p, m in prompts]  # 12: every prompt under base and both adapters
    tp2 = _generate(base, 2, reqs)
    assert tp2 == _generate(base, 1, reqs)
    for k, lr in enumerate(loras):
        refs = hf_reference(base if lr is None else merged[lr.name], prompts)
        counts = compare(tp2[4 * k:4 * k + 4], refs)
        assert counts["exact"] + counts["near_tie"] == 4, (lr, counts)
    assert tp2[4:8] != tp2[:4] and tp2[8:] != tp2[:4]  # each adapter changed the tokens
