"""Batch-invariant mode end to end (issue 24), in the style of SGLang's ``test_deterministic``:

* ``single``: one prompt 30 times among random batches; ``mixed``: several prompts interleaved;
  ``prefix``: prompts sharing a long prefix, with prefix-cache hits and misses. Every trial runs on
  one of four engines: chunked-prefill budgets of 16, 64 and 2048 tokens, and one with so few KV
  blocks that requests are preempted (and recomputed). A request must give exactly one distinct
  output (token ids and logprob floats, bitwise) over all of them.
* the same shapes in the default mode give more than one (else the test could not fail);
* batch size 1 vs N, greedy and seeded, speculation off and on: bitwise the same;
* transformers parity (fp32, greedy) still holds.

Two architectures (llama; qwen2, whose QKV bias goes through the kernel's bias path), fp32 and
bf16. Prefixes are 1,040 tokens: in one chunk of the 2048 budget, a chunk that long takes the torch
prefill attention in the default mode, and the cached-prefix path the C kernel; that is where bf16
differs by default (its oneDNN matmul happens to keep its blocking across M on AVX-512 machines).
"""
from __future__ import annotations

import contextlib
import os
import random
import zlib

import pytest

from asyncengine import LLM, SamplingParams
from model_utils import compare

ARCHS = ("llama", "qwen2")
DTYPES = ("float32", "bfloat16")
VOCAB = 512
BUDGETS = (16, 64, 2048)
PREFIX_LEN = 1040  # > cpu_backend.KERNEL_MAX_QUERY_LEN: the default mode's torch prefill route


@pytest.fixture(scope="module")
def long_ckpt(tiny_model_dir):
    """Tiny checkpoints whose positions reach the long prefixes."""
    return lambda arch: tiny_model_dir(arch, max_position_embeddings=2048)


@contextlib.contextmanager
def unpacked_linears(on: bool):
    """The default mode's control engines multiply through ``F.linear``: the oneDNN-packed fp32
    projections (layers/packed_linear.py, on by default) happen to keep their blocking across M on
    AVX-512 machines, as bf16 does, and would make the control invariant by luck on these shapes.
    Engines (and their worker processes) read the switch when they are built."""
    if not on:
        yield
        return
    old = os.environ.get("ASYNCENGINE_PREPACK")
    os.environ["ASYNCENGINE_PREPACK"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["ASYNCENGINE_PREPACK"]
        else:
            os.environ["ASYNCENGINE_PREPACK"] = old


def engines(model_dir: str, dtype: str, invariant: bool, mode: str, **options) -> dict[str, LLM]:
    with unpacked_linears(not invariant):
        return _engines(model_dir, dtype, invariant, mode, **options)


def _engines(model_dir: str, dtype: str, invariant: bool, mode: str, **options) -> dict[str, LLM]:
    common = dict(dtype=dtype, batch_invariant=invariant, max_model_len=2048, num_threads=1, seed=0, **options)
    out = {f"budget{b}": LLM(model_dir, max_num_batched_tokens=b, num_kv_blocks=768, **common) for b in BUDGETS}
    # blocks of 16 for one request but not for a batch: preemption. Prefix mode: one long-prefix
    # request fits in 70 (at most 68 blocks), two do not; else one 80 + 16 token request fits in 8
    out["preempt"] = LLM(model_dir, max_num_batched_tokens=64, num_kv_blocks=70 if mode == "prefix" else 8,
                         **common)
    return out


def shutdown(pool: dict[str, LLM]) -> None:
    for llm in pool.values():
        llm.shutdown()


def key(out) -> tuple:
    """Token ids and every logprob float of a request's output: what must not change."""
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in pos.items())) for pos in c.logprobs)


def random_prompt(rng: random.Random, lo: int = 3, hi: int = 80) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))]


def targets_for(mode: str, rng: random.Random) -> list[list[int]]:
    if mode == "single":
        return [random_prompt(rng, 40, 40)]
    if mode == "mixed":
        return [random_prompt(rng, 5, 70) for _ in range(3)]
    prefix = random_prompt(rng, PREFIX_LEN, PREFIX_LEN)
    return [prefix + random_prompt(rng, 5, 30) for _ in range(2)]


def run_trials(pool: dict[str, LLM], mode: str, trials: int, seed: int, stop_when_differs: bool = False):
    """Each trial: one engine (in turn), a random batch with a random non-empty subset of the targets
    at random places. Returns (distinct outputs per target, preemptions seen)."""
    rng = random.Random(seed)
    targets = targets_for(mode, rng)
    seen: list[set] = [set() for _ in targets]
    names = list(pool)
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    for t in range(trials):
        name = names[t % len(names)]
        llm = pool[name]
        chosen = [i for i in range(len(targets)) if rng.random() < 0.7] or [rng.randrange(len(targets))]
        if name == "preempt":  # a batch the small cache cannot hold at once
            chosen = list(range(len(targets)))
        if name == "preempt":  # long enough to outgrow the small cache while they decode together
            batch = [(None, random_prompt(rng, 40, 80)) for _ in range(rng.randint(4, 8))]
        else:
            batch = [(None, random_prompt(rng)) for _ in range(rng.randint(0, 10))]
        for i in chosen:
            batch.insert(rng.randint(0, len(batch)), (i, targets[i]))
        params = [sp if i is not None else SamplingParams(max_tokens=rng.randint(1, 16), temperature=0.0,
                                                           ignore_eos=True) for i, _ in batch]
        outs = llm.generate([{"prompt_token_ids": p} for _, p in batch], params, use_tqdm=False)
        for (i, _), o in zip(batch, outs):
            if i is not None:
                seen[i].add(key(o))
        if stop_when_differs and any(len(s) > 1 for s in seen):
            break
    preemptions = sum(llm.engine.stats()["num_preemptions"] for llm in pool.values())
    return [len(s) for s in seen], preemptions


TRIALS = {"single": 30, "mixed": 12, "prefix": 12}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["single", "mixed", "prefix"])
def test_deterministic(mode, arch, dtype, long_ckpt):
    model_dir = long_ckpt(arch)
    pool = engines(model_dir, dtype, True, mode)
    try:
        distinct, preemptions = run_trials(pool, mode, TRIALS[mode], seed=zlib.crc32(f"{mode}-{arch}-{dtype}".encode()))
    finally:
        shutdown(pool)
    assert distinct == [1] * len(distinct), f"invariant mode: distinct outputs per request {distinct}"
    assert preemptions > 0, "the small-cache engine never preempted: the test lost its preemption case"

    pool = engines(model_dir, dtype, False, mode)
    try:
        # the default mode on the same shapes: fp32 differs in any batch mix (F.linear's blocking follows
        # M); bf16 only where a long chunk takes the torch prefill (the prefix mode)
        distinct_default, _ = run_trials(pool, mode, TRIALS[mode], seed=zlib.crc32(f"{mode}-{arch}-{dtype}".encode()),
                                         stop_when_differs=True)
    finally:
        shutdown(pool)
    if dtype == "float32" or mode == "prefix":
        assert max(distinct_default) > 1, "the default mode gave one output too: these shapes prove nothing"


@pytest.mark.parametrize("quantization,activations", [("int8", "fp32"), ("int4", "int8")])
def test_deterministic_quantized(quantization, activations, long_ckpt):
    """Q8_0 / Q4_1 weights, through the native decode step (steps of <= 32 rows) and the per-op
    model. With fp32 activations the default hands steps of 48 rows and more to dequantize +
    torch.mm, so a prefill chunk rounds differently from a decode; invariant mode keeps the per-row
    kernel. int8 activations run their integer kernel at every M in both modes."""
    model_dir = long_ckpt("llama")
    for invariant in (True, False):
        pool = engines(model_dir, "float32", invariant, "mixed", quantization=quantization,
                       quantized_activations=activations)
        try:
            distinct, _ = run_trials(pool, "mixed", 8, seed=5, stop_when_differs=not invariant)
        finally:
            shutdown(pool)
        if invariant:
            assert distinct == [1] * len(distinct), f"invariant mode: distinct outputs per request {distinct}"
        elif activations == "fp32":
            assert max(distinct) > 1, "the default mode gave one output too: these shapes prove nothing"


def spec_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Repetitive prompts, so the n-gram proposer finds matches and drafts tokens."""
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 6))]
        out.append((motif * 8)[:rng.randint(12, 45)])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_batch_1_vs_n_bitwise_with_and_without_speculation(arch, dtype, long_ckpt):
    """vLLM's bs=1 vs bs=N logprobs test, greedy and seeded, speculation off and on: all four runs
    of a request give the same token ids and logprob floats."""
    model_dir = long_ckpt(arch)
    rng = random.Random(7)
    prompts = spec_prompts(rng, 6)
    kinds = {"greedy": [SamplingParams(max_tokens=10, temperature=0.0, logprobs=4, ignore_eos=True)] * 6,
             "seeded": [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=100 + i, logprobs=4,
                                       ignore_eos=True) for i in range(6)]}
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    results: dict[str, dict[str, list]] = {k: {} for k in kinds}
    for spec_on in (False, True):
        llm = LLM(model_dir, dtype=dtype, batch_invariant=True, num_threads=1, max_model_len=256,
                  speculative_config=spec if spec_on else None, enable_prefix_caching=False)
        try:
            for kind, params in kinds.items():
                alone = [key(llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0])
                         for p, sp in zip(prompts, params)]
                batched = [key(o) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]
                results[kind][f"spec={spec_on} bs=1"] = alone
                results[kind][f"spec={spec_on} bs=N"] = batched
        finally:
            llm.shutdown()
    for kind, runs in results.items():
        first_name, first = next(iter(runs.items()))
        for name, got in runs.items():
            for i, (a, b) in enumerate(zip(first, got)):
                assert a == b, f"{kind}, request {i}: {name} differs from {first_name}"


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_parity_fp32_in_invariant_mode(arch, tiny_model_dir, tiny_reference):
    requests, refs = tiny_reference(arch)
    with LLM(tiny_model_dir(arch), dtype="float32", batch_invariant=True, num_threads=1) as llm:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p, _ in requests],
                            [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in requests],
                            use_tqdm=False)
    counts = compare([o.outputs[0].token_ids for o in outs], refs)
    assert counts["exact"] + counts["near_tie"] == counts["total"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_does_not_change_bits(dtype, long_ckpt):
    """Every invariant kernel splits its work over rows, output columns or sequences, never over a
    reduction: 1 and 2 threads give the same bits (the docs promise no more than this machine kind)."""
    rng = random.Random(11)
    prompts = [random_prompt(rng, 3, 300) for _ in range(8)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    got = []
    for threads in (1, 2):
        with LLM(long_ckpt("llama"), dtype=dtype, batch_invariant=True, num_threads=threads,
                 max_model_len=512) as llm:
            got.append([key(o) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                      use_tqdm=False)])
    assert got[0] == got[1]


def test_unsupported_setups_are_refused(tiny_llama_dir):
    """No silent fallback: what cannot keep a row's bits independent of the batch says so."""
    from asyncengine import EngineConfig
    from asyncengine.errors import ConfigError

    for name in ("triton", "torch"):
        with pytest.raises(ConfigError, match=f"the '{name}' backend has no batch-invariant mode"):
            EngineConfig(model=tiny_llama_dir, batch_invariant=True, attention_backend=name)
    with pytest.raises(ConfigError, match="CPU kernels only"):
        EngineConfig(model=tiny_llama_dir, batch_invariant=True, device="cuda")


def test_refused_without_the_c_kernels(tiny_llama_dir, kernels_off):
    from asyncengine.errors import ConfigError

    with pytest.raises(ConfigError, match="needs the CPU C kernels.*ASYNCENGINE_CPU_KERNELS=0"):
        LLM(tiny_llama_dir, dtype="float32", batch_invariant=True)


def test_tensor_parallel_two_ranks(long_ckpt):
    """tensor_parallel_size=2 (worker processes, gloo): the rank-ordered all-reduce and the per-rank
    invariant kernels give one output per request; the default mode gives several."""
    for invariant in (True, False):
        with unpacked_linears(not invariant):
            llm = LLM(long_ckpt("llama"), dtype="float32", batch_invariant=invariant, tensor_parallel_size=2,
                      num_threads=1, max_num_batched_tokens=64, num_kv_blocks=256, max_model_len=512)
        try:
            distinct, _ = run_trials({"tp2": llm}, "mixed", 6, seed=3, stop_when_differs=not invariant)
        finally:
            llm.shutdown()
        if invariant:
            assert distinct == [1] * len(distinct), f"invariant mode: distinct outputs per request {distinct}"
        else:
            assert max(distinct) > 1, "the default mode gave one output too: these shapes prove nothing"
