"""The native decode step (asyncengine/models/llama_native.py, kernels/cpu/step.c) against the
per-op model it replaces: the same kernels in the same order, so greedy outputs must be
token-exact, in fp32 and in int8 activations alike, on batches of several sequences (the attention
tables), with a QKV bias (Qwen2), per-head q/k norms (Qwen3), a tied head, and every block format. Also: the native step really
ran, the per-op path runs where it does not apply, and the switch refuses what it cannot do."""
from __future__ import annotations

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.models import llama_native
from gguf_utils import tiny_hf_model, write_tiny_gguf
from model_utils import decode_step_runner, random_requests

VOCAB = 320
REQUESTS = random_requests(6, VOCAB, seed=11, plen=(3, 40), olen=(4, 14))
COMMON = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=128, num_threads=2,
              freeze_gc_after_load=False, max_num_seqs=4)
CASES = [("llama", "Q4_1", {}), ("qwen2", "Q8_0", {}), ("llama", "Q4_0", {"tie_word_embeddings": True}),
         ("qwen3", "Q8_0", {})]  # Qwen3: per-head q/k norms


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    d = tmp_path_factory.mktemp("native-gguf")
    return {(a, q): str(write_tiny_gguf(d / f"{a}-{q}.gguf", tiny_hf_model(a, VOCAB, seed=7, **kw), None, qtype=q))
            for a, q, kw in CASES}


def _count_native(worker):
    """Wrap the worker's native step so that its calls are counted (None: it has none)."""
    step = worker.model.native_step
    if step is None:
        return None
    real = step.__call__

    class Counting:
        def __init__(self):
            self.calls = 0

        def accepts(self, *a):
            return step.accepts(*a)

        def __call__(self, *a):
            self.calls += 1
            return real(*a)

    worker.model.native_step = Counting()
    return True


def _calls(worker):
    s = worker.model.native_step
    return None if s is None else s.calls


def run(path, monkeypatch, native: str, activations: str, **options):
    monkeypatch.setenv("ASYNCENGINE_NATIVE_STEP", native)
    llm = LLM(path, quantized_activations=activations, **COMMON, **options)
    try:
        core = llm.engine
        core.collective_rpc(_count_native)
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in REQUESTS],
                            [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in REQUESTS],
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], core.collective_rpc(_calls)[0]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("arch,qtype", [(a, q) for a, q, _ in CASES])
def test_native_step_is_token_exact_with_the_per_op_path(arch, qtype, activations, ggufs, monkeypatch):
    native, calls = run(ggufs[(arch, qtype)], monkeypatch, "1", activations)
    per_op, none = run(ggufs[(arch, qtype)], monkeypatch, "0", activations)
    assert none is None and calls > sum(n for _, n in REQUESTS) // COMMON["max_num_seqs"]
    assert native == per_op


def test_native_step_with_the_int8_kv_cache(ggufs, monkeypatch):
    """kv_cache_dtype="int8": the native step calls the same int8 attention kernel as the per-op
    path (attention_i8.c), so the two stay token-exact."""
    path = ggufs[("llama", "Q4_1")]
    native, calls = run(path, monkeypatch, "1", "int8", kv_cache_dtype="int8")
    per_op, none = run(path, monkeypatch, "0", "int8", kv_cache_dtype="int8")
    assert none is None and calls > sum(n for _, n in REQUESTS) // COMMON["max_num_seqs"]
    assert native == per_op


def _one_step_setup(path):
    """The model, and a function running one decode step of 3 sequences over a filled context
    (natively or per op) from the same KV state each time."""
    from asyncengine.config import EngineConfig
    from asyncengine.models.loader import load_model

    model = load_model(EngineConfig(model=path, dtype="float32"), tokenizer=False).model
    run, meta = decode_step_runner(model, [3, 100, 200], [5, 17, 30])
    native = llama_native.NativeStep.for_model(model)
    assert native is not None and native.accepts(3, meta)

    def step(use_native: bool) -> torch.Tensor:
        model.native_step = native if use_native else None
        return run()

    return model, step


def test_hidden_states_are_bit_identical(ggufs, monkeypatch):
    """One decode step of 3 sequences, straight through the model: the native step's hidden states
    equal the per-op model's to the bit (same kernels, same order)."""
    _, step = _one_step_setup(ggufs[("llama", "Q4_1")])
    per_op = step(False)
    assert torch.equal(step(True), per_op)


def test_the_native_step_follows_a_switch_of_activations_and_layout(ggufs):
    """Switching the layers' activation mode between steps (which also repacks their weights in
    place) reaches the native step: its table of kernels is rebuilt, not reused (it once was)."""
    from asyncengine.kernels.cpu import repack
    from asyncengine.layers.linear import Linear
    from asyncengine.worker.worker import set_quantized_activations

    model, step = _one_step_setup(ggufs[("llama", "Q4_1")])
    out = {}
    for mode in ("fp32", "int8", "fp32"):
        set_quantized_activations(model, mode)
        packed = {m.packed for m in model.modules() if isinstance(m, Linear) and m.quantized}
        assert packed == {False} if mode == "fp32" or not repack.can_pack(8) else True in packed
        native, per_op = step(True), step(False)
        assert torch.equal(native, per_op), mode
        assert out.setdefault(mode, native) is native or torch.equal(out[mode], native)
    assert not torch.equal(out["fp32"], out["int8"])


def test_where_it_does_not_apply(ggufs, monkeypatch):
    from asyncengine.config import EngineConfig
    from asyncengine.models.loader import load_model

    dense = load_model(EngineConfig(model=ggufs[("llama", "Q4_1")], dtype="float32", quantization="none"),
                       tokenizer=False).model
    assert "dense" in llama_native.native_step_reason(dense)
    monkeypatch.setenv("ASYNCENGINE_NATIVE_STEP", "auto")
    assert llama_native.NativeStep.for_model(dense) is None
    monkeypatch.setenv("ASYNCENGINE_NATIVE_STEP", "1")
    with pytest.raises(ValueError, match="cannot run natively: a projection is dense"):
        llama_native.NativeStep.for_model(dense)
    monkeypatch.setenv("ASYNCENGINE_NATIVE_STEP", "yes")
    with pytest.raises(ValueError, match="ASYNCENGINE_NATIVE_STEP='yes'"):
        llama_native.NativeStep.for_model(dense)


def test_the_step_releases_the_interpreter_lock(ggufs):
    """ctypes releases the GIL around a foreign call unless the function is a Python-API one
    (PyDLL): the whole step then runs with the lock free for the app's own threads."""
    import ctypes

    from asyncengine.config import EngineConfig
    from asyncengine.models.loader import load_model

    model = load_model(EngineConfig(model=ggufs[("llama", "Q4_1")], dtype="float32"), tokenizer=False).model
    step = llama_native.NativeStep.for_model(model)
    assert isinstance(step.lib, ctypes.CDLL) and not isinstance(step.lib, ctypes.PyDLL)
    assert not step.fn._flags_ & ctypes._FUNCFLAG_PYTHONAPI
