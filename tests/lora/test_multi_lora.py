"""Multi-LoRA through the engine (tiny Llama and tiny Qwen2): 16 requests mixing the base model and
three adapters (ranks 4, 8, 16 over different modules) with max_loras=2, greedy token-exact against transformers + PEFT
merge_and_unload per adapter. The same prompts run under every adapter with prefix caching on: a KV
block shared across adapters would change the tokens (the block hash includes the adapter)."""
import pytest

from asyncengine import LLM, LoRARequest, SamplingParams
from asyncengine.errors import InvalidRequestError
from lora_utils import ADAPTERS, make_adapter, merged_model_dir
from model_utils import compare, random_requests


def _watch_adapters(worker) -> None:
    lm, seen = worker.runner.lora, []
    worker.lora_seen, inner = seen, lm.set_rows

    def set_rows(ids):
        seen.append(len(set(ids) - {0}))
        inner(ids)

    lm.set_rows = set_rows


def _max_adapters_per_step(worker) -> list[int]:
    return worker.lora_seen


def _setup(tiny_model_dir, tmp_path_factory, arch: str):
    base = tiny_model_dir(arch)
    root = tmp_path_factory.mktemp(f"loras-{arch}")
    adapters = {n: make_adapter(base, str(root / n), n, seed=k) for k, n in enumerate(ADAPTERS)}
    merged = {n: merged_model_dir(base, p, str(root / f"merged-{n}")) for n, p in adapters.items()}
    return base, adapters, merged


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    return _setup(tiny_model_dir, tmp_path_factory, "llama")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_setup(request, tiny_model_dir, tmp_path_factory, setup):
    return setup if request.param == "llama" else _setup(tiny_model_dir, tmp_path_factory, request.param)


def test_mixed_batch_token_exact(arch_setup, hf_reference):
    base, adapters, merged = arch_setup
    prompts = random_requests(4, 512, seed=5, plen=(20, 40), olen=(6, 10))
    loras = [None] + [LoRARequest(n, i, p) for i, (n, p) in enumerate(adapters.items(), start=1)]
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3,
              max_num_seqs=16)
    llm.engine.collective_rpc(_watch_adapters)
    reqs = [(p, m, lr) for lr in loras for p, m in prompts]  # 16: every prompt under every adapter
    outs = llm.generate([list(p) for p, _, _ in reqs],
                        [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m, _ in reqs],
                        use_tqdm=False, lora_request=[lr for _, _, lr in reqs])
    got = [o.outputs[0].token_ids for o in outs]
    base_tokens = None
    for k, lr in enumerate(loras):
        ref_dir = base if lr is None else merged[lr.name]
        refs = hf_reference(ref_dir, prompts)
        mine = got[4 * k:4 * k + 4]
        counts = compare(mine, refs)
        assert counts["exact"] + counts["near_tie"] == 4
        if lr is None:
            base_tokens = mine
        else:
            assert mine != base_tokens  # the adapter did change the tokens
    assert max(llm.engine.collective_rpc(_max_adapters_per_step)[0]) == 2  # never 3 in one step


def test_bad_requests_refused_and_engine_serves(setup, tmp_path, tiny_model_dir):
    base, adapters, _ = setup
    other = make_adapter(tiny_model_dir("llama", num_key_value_heads=4), str(tmp_path / "other"), "a4")
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=4)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="rank 8"):
        llm.generate([[5, 6, 7]], sp, lora_request=LoRARequest("a8", 2, adapters["a8"]))
    with pytest.raises(InvalidRequestError, match="no such folder"):
        llm.generate([[5, 6, 7]], sp, lora_request=LoRARequest("x", 3, str(tmp_path / "none")))
    with pytest.raises(InvalidRequestError, match="another base model"):
        llm.generate([[5, 6, 7]], sp, lora_request=LoRARequest("other", 4, other))
    ok = llm.generate([[5, 6, 7]], sp, lora_request=LoRARequest("a4", 1, adapters["a4"]))
    assert len(ok[0].outputs[0].token_ids) == 3
    plain = LLM(base, dtype="float32")
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        plain.generate([[5, 6, 7]], sp, lora_request=LoRARequest("a4", 1, adapters["a4"]))


def _hostile_copies(src: str, root) -> dict[str, str]:
    """Copies of a good adapter that pass the header checks but not a read of their values or
    options: a NaN in lora_B, a config with alpha_pattern, a weights file cut short."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = {}
    for kind in ("nan", "alpha_pattern", "truncated"):
        d = root / kind
        shutil.copytree(src, d)
        out[kind] = str(d)
    tensors = load_file(f"{src}/adapter_model.safetensors")
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(root / "nan" / "adapter_model.safetensors"))
    cfg = json.loads((root / "alpha_pattern" / "adapter_config.json").read_text())
    cfg["alpha_pattern"] = {"q_proj": 32}
    (root / "alpha_pattern" / "adapter_config.json").write_text(json.dumps(cfg))
    weights = root / "truncated" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return out


def test_adapters_bad_inside_are_refused_and_nothing_else_changes(setup, tmp_path, hf_reference):
    """Hostile adapters whose headers look right (NaN values, an option we do not apply, a file cut
    short) and one id given to two folders: each an InvalidRequestError before anything is queued;
    base and good-adapter requests before and after give transformers' tokens."""
    base, adapters, merged = setup
    bad = _hostile_copies(adapters["a4"], tmp_path)
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    prompts = random_requests(2, 512, seed=9, plen=(8, 16), olen=(5, 5))
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    good = LoRARequest("a4", 1, adapters["a4"])

    def run():
        outs = llm.generate([list(p) for p, _ in prompts] * 2, sp, use_tqdm=False, lora_request=[None, None, good, good])
        return [o.outputs[0].token_ids for o in outs]

    before = run()
    for kind, match in (("nan", "NaN or infinite"), ("alpha_pattern", "alpha_pattern"), ("truncated", "cut short")):
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate([[5, 6, 7]], sp, lora_request=LoRARequest(kind, 10, bad[kind]))
    with pytest.raises(InvalidRequestError, match="LoRA id 1 already names"):
        llm.generate([[5, 6, 7]], sp, lora_request=LoRARequest("a8", 1, adapters["a8"]))
    after = run()
    assert after == before
    for got, ref_dir in ((after[:2], base), (after[2:], merged["a4"])):
        counts = compare(got, hf_reference(ref_dir, prompts))
        assert counts["exact"] + counts["near_tie"] == 2
    assert llm.engine.stats()["num_waiting"] + llm.engine.stats()["num_running"] == 0


def _count_loads(worker) -> None:
    lm = worker.runner.lora
    worker.lora_loads, inner = [], lm.load

    def load(name, lora_id, path):
        worker.lora_loads.append(lora_id)
        return inner(name, lora_id, path)

    lm.load = load


def _loads_and_host(worker) -> tuple[list[int], int]:
    return worker.lora_loads, len(worker.runner.lora.slots.host)


def test_host_lru_evicts_and_reloads_from_disk(setup, hf_reference):
    """One device slot and one host copy: every change of adapter evicts the last one from host
    memory, so the first adapter comes back from disk; each run equals transformers + PEFT."""
    base, adapters, merged = setup
    prompts = random_requests(2, 512, seed=13, plen=(8, 20), olen=(5, 5))
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=1)
    llm.engine.collective_rpc(_count_loads)
    order = [("a4", 1), ("a8", 2), ("a16", 3), ("a4", 1)]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for name, i in order:
        outs = llm.generate([list(p) for p, _ in prompts], sp, use_tqdm=False,
                            lora_request=LoRARequest(name, i, adapters[name]))
        counts = compare([o.outputs[0].token_ids for o in outs], hf_reference(merged[name], prompts))
        assert counts["exact"] + counts["near_tie"] == 2, name
    loads, host = llm.engine.collective_rpc(_loads_and_host)[0]
    assert loads == [1, 2, 3, 1]  # a4 was evicted from host memory and read from disk again
    assert host <= 2  # max_cpu_loras, plus one while the others hold the slots (lora/slots.py)
