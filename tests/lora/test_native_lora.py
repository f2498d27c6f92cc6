"""LoRA inside the native C decode step (kernels/cpu/lora.c, called from models/llama_native.py).

The base is block-quantized (``quantization="int8"``: Q8_0 blocks at load) from a checkpoint whose
weights already are Q8_0 values, so the blocks hold exactly the dense weights and transformers +
PEFT ``merge_and_unload`` on that checkpoint is the reference. 16 requests mix the base model and
three adapters (ranks 4, 8, 16 over different modules) through max_loras=2 slots; the native step
must give the torch path's tokens (``ASYNCENGINE_NATIVE_STEP=0``, hooks) and the reference's, and
must really have run steps with adapter rows (its counter), so the test cannot pass on the torch
path alone. One step straight through the model checks the hidden states: adapter rows near the
torch path's, base rows bit-identical to a step without adapters."""
import pytest
import torch
import transformers

from asyncengine import LLM, LoRARequest, SamplingParams
from gguf_utils import quantized_reference
from lora_utils import ADAPTERS, make_adapter, merged_model_dir
from model_utils import compare, decode_step_runner, random_requests

COMMON = dict(dtype="float32", quantization="int8", quantized_activations="fp32", skip_tokenizer_init=True,
              num_threads=2, freeze_gc_after_load=False)


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("native-lora")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    with torch.no_grad():  # every matrix (the embedding and head too) to the values Q8_0 blocks hold
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(quantized_reference(p, "Q8_0"))
    base = str(root / "base-q8")
    model.save_pretrained(base)
    adapters = {n: make_adapter(base, str(root / n), n, seed=k) for k, n in enumerate(ADAPTERS)}
    merged = {n: merged_model_dir(base, p, str(root / f"merged-{n}")) for n, p in adapters.items()}
    return base, adapters, merged


def _lora_calls(worker):
    step = worker.model.native_step
    return None if step is None else step.lora_calls


def _generate(llm, loras, prompts) -> list[list[int]]:
    reqs = [(p, m, lr) for lr in loras for p, m in prompts]  # every prompt under every adapter
    outs = llm.generate([{"prompt_token_ids": list(p)} for p, _, _ in reqs],
                        [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m, _ in reqs],
                        use_tqdm=False, lora_request=[lr for _, _, lr in reqs])
    return [o.outputs[0].token_ids for o in outs]


def _run(base, loras, prompts, native: str, monkeypatch):
    monkeypatch.setenv("ASYNCENGINE_NATIVE_STEP", native)
    with LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3, max_num_seqs=16,
             **COMMON) as llm:
        return _generate(llm, loras, prompts), llm.engine.collective_rpc(_lora_calls)[0]


def test_native_step_with_adapters_is_token_exact(setup, hf_reference, monkeypatch):
    base, adapters, merged = setup
    prompts = random_requests(4, 512, seed=5, plen=(5, 30), olen=(6, 10))
    loras = [None] + [LoRARequest(n, i, p) for i, (n, p) in enumerate(adapters.items(), start=1)]
    native, calls = _run(base, loras, prompts, "1", monkeypatch)
    per_op, none = _run(base, loras, prompts, "0", monkeypatch)
    assert none is None and calls >= 5  # decode steps with adapter rows ran natively
    assert native == per_op
    for k, lr in enumerate(loras):
        mine = native[4 * k:4 * k + 4]
        counts = compare(mine, hf_reference(base if lr is None else merged[lr.name], prompts))
        assert counts["exact"] + counts["near_tie"] == 4
        if lr is not None:
            assert mine != native[:4]  # the adapter did change the tokens


def test_one_step_adapter_rows_and_base_rows(setup, monkeypatch):
    from asyncengine.config import EngineConfig
    from asyncengine.lora.hooks import LoRAModel
    from asyncengine.models import llama_native
    from asyncengine.models.loader import load_model

    base, adapters, _ = setup
    monkeypatch.setenv("ASYNCENGINE_NATIVE_STEP", "1")
    model = load_model(EngineConfig(model=base, dtype="float32", quantization="int8"), tokenizer=False).model
    lm = LoRAModel(model, max_loras=2, max_lora_rank=16, max_cpu_loras=3)
    for i, (name, path) in enumerate(adapters.items(), start=1):
        lm.load(name, i, path)
    run, _ = decode_step_runner(model, [3, 100, 200, 7], [5, 17, 30, 9])
    native = llama_native.NativeStep.for_model(model)

    def step(rows: list[int], use_native: bool) -> torch.Tensor:
        lm.set_rows(rows)
        model.native_step = native if use_native else None
        return run()

    mixed = [1, 0, 3, 1]  # adapter 1's rows apart (not one slice), a base row, the rank-16 adapter
    got, torch_path = step(mixed, True), step(mixed, False)
    assert native.lora_calls == 1
    plain = step([0, 0, 0, 0], True)
    assert native.lora_calls == 1  # a step of base rows only passes no adapters
    torch.testing.assert_close(got, torch_path, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[1], plain[1])  # the base row: not touched, to the bit
    for r in (0, 2, 3):
        assert (got[r] - plain[r]).abs().max() > 1e-2  # the adapters changed their rows


def test_adapters_survive_sleep_level_2(setup, monkeypatch):
    """Level 2 drops the model and wake_up reads it again: the adapters' hooks and slots move onto
    the new model (LoRAModel.attach), whose new native step runs them: the same tokens."""
    base, adapters, _ = setup
    monkeypatch.setenv("ASYNCENGINE_NATIVE_STEP", "1")
    prompts = random_requests(2, 512, seed=6, plen=(5, 20), olen=(5, 8))
    loras = [None] + [LoRARequest(n, i, p) for i, (n, p) in enumerate(adapters.items(), start=1)][1:]
    with LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, **COMMON) as llm:
        before = _generate(llm, loras, prompts)
        assert before[2:4] != before[:2] and before[4:] != before[:2]
        while llm.engine.oldest_batch() is not None:  # a batch planned past the last finish
            llm.engine.step()
        llm.sleep(2)
        llm.wake_up()
        assert llm.engine.collective_rpc(_lora_calls)[0] == 0  # a fresh step on the reloaded model
        assert _generate(llm, loras, prompts) == before
        assert llm.engine.collective_rpc(_lora_calls)[0] > 0


def test_hooks_take_the_c_loop_on_cpu_fp32(setup, monkeypatch):
    """A dense fp32 model on the per-op path (no native step): its hooks add the adapters through
    lora.c too, one call per projection; the rows equal grouped.py's torch apply within fp32
    summation order, base rows untouched."""
    from asyncengine.config import EngineConfig
    from asyncengine.lora.hooks import LoRAModel
    from asyncengine.models.loader import load_model

    base, adapters, _ = setup
    model = load_model(EngineConfig(model=base, dtype="float32"), tokenizer=False).model
    model.native_step = None
    lm = LoRAModel(model, max_loras=2, max_lora_rank=16, max_cpu_loras=3)
    for i, (name, path) in enumerate(adapters.items(), start=1):
        lm.load(name, i, path)
    run, _ = decode_step_runner(model, [3, 100, 200, 7], [5, 17, 30, 9])
    mixed = [1, 0, 3, 1]
    lm.set_rows(mixed)
    assert lm.step_groups is not None and lm.cpu_kernel_reason() is None
    with_c = run()
    lm.set_rows(mixed)
    lm.step_groups = None  # grouped.py's torch apply
    with_torch = run()
    lm.set_rows([0, 0, 0, 0])
    plain = run()
    torch.testing.assert_close(with_c, with_torch, rtol=1e-4, atol=1e-4)
    assert torch.equal(with_c[1], plain[1])
    for r in (0, 2, 3):
        assert (with_c[r] - plain[r]).abs().max() > 1e-2
    from asyncengine.lora.hooks import C_LOOP_MAX_ROWS

    lm.set_rows([1] * (C_LOOP_MAX_ROWS + 1))  # a prefill-sized step: torch's matmuls
    assert lm.groups is not None and lm.step_groups is None
