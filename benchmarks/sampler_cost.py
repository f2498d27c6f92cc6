#!/usr/bin/env python
"""The sampler's share of the model thread's step, on a workload through ``LLM.generate``.

    python benchmarks/sampler_cost.py --model models/llama-bench --dtype bfloat16 --workload offline \
        --limit 64 --sampling greedy --out /tmp/sampler.json

Times, on the worker, every ``runner.execute`` (the step) and, inside it, the runner's sampling
(``runner._sample``: logits, metadata, sampler) and the LM head within that (``compute_logits``):
``sampler_s`` is the sampling less the head, ``sampler_share`` its fraction of the steps' time.
Output tok/s counts the workload's useful tokens (EOS ignored). ``--sampling``:

  greedy    temperature 0 (the offline benchmark's requests)
  default   the engine's defaults (greedy with a presence penalty of 0.3: what a chat request gets)
  mixed     a quarter each: greedy; temperature 0.8 / top-p 0.95, seeded; top-k 40 with a repetition
            penalty of 1.1; greedy with frequency 0.2 and logprobs=2

The script only uses what every version of the runner has, so an A/B between two checkouts is
``PYTHONPATH=<checkout> python benchmarks/sampler_cost.py ...`` on each, alternated.
``--micro 1 64 256`` times the sampler's parts alone (no model) at those row counts.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def params_for(mode: str, i: int, max_tokens: int):
    from asyncengine import SamplingParams

    base = dict(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    if mode == "greedy":
        return SamplingParams(temperature=0.0, **base)
    if mode == "default":
        return SamplingParams(**base)
    kind = i % 4
    if kind == 0:
        return SamplingParams(temperature=0.0, **base)
    if kind == 1:
        return SamplingParams(temperature=0.8, top_p=0.95, seed=i, **base)
    if kind == 2:
        return SamplingParams(temperature=1.0, top_k=40, repetition_penalty=1.1, seed=i, **base)
    return SamplingParams(temperature=0.0, frequency_penalty=0.2, logprobs=2, **base)


def micro(rows: int, vocab: int = 32000, prompt: int = 300, out: int = 50) -> dict:
    """One core, best of 15, milliseconds: torch.argmax against argmax_rows (fp32 and bf16), and
    a penalized batch's metadata from the lists (SamplingMetadata.build) against the persistent
    batch (SamplingBatch.metadata: one new token per row per step)."""
    import torch

    from asyncengine.sampling_params import SamplingParams, resolve_unset
    from asyncengine.worker.request_state import RunnerRequestState
    from asyncengine.worker.sampler_ops import argmax_rows
    from asyncengine.worker.sampling_batch import SamplingBatch
    from asyncengine.worker.sampling_metadata import SamplingMetadata

    torch.set_num_threads(1)

    def best(fn, n: int = 15) -> float:
        fn()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return round(min(times) * 1e3, 3)

    x = torch.randn(rows, vocab)
    xb = x.bfloat16()
    p = resolve_unset(SamplingParams(max_tokens=1000))  # the engine's default: greedy + presence 0.3
    states = [RunnerRequestState(req_id=str(i), num_prompt_tokens=prompt, prompt_ids=list(range(prompt)),
                                 output_ids=list(range(out)), block_ids=[], num_computed_tokens=prompt + out,
                                 sampling_params=p, bad_words_token_ids=None) for i in range(rows)]
    batch = SamplingBatch(vocab, [1], torch.device("cpu"))

    def step():
        batch.metadata(states)
        for st in states:  # the runner appends each sampled token
            st.output_ids.append(7)

    return {"rows": rows, "vocab": vocab, "argmax_fp32_torch_ms": best(lambda: x.argmax(-1)),
            "argmax_fp32_rows_ms": best(lambda: argmax_rows(x)),
            "argmax_bf16_float_then_torch_ms": best(lambda: xb.float().argmax(-1)),
            "argmax_bf16_rows_ms": best(lambda: argmax_rows(xb)),
            "penalty_meta_lists_ms": best(lambda: SamplingMetadata.build(
                [p] * rows, [st.prompt_ids for st in states], [st.output_ids for st in states], [1],
                [None] * rows, vocab, torch.device("cpu"))),
            "penalty_meta_persistent_ms": best(step)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--workload", default="offline")
    ap.add_argument("--limit", type=int, default=0, help="only the first N requests")
    ap.add_argument("--sampling", default="greedy", choices=["greedy", "default", "mixed"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--micro", type=int, nargs="*", help="only the sampler's parts at these row counts")
    args = ap.parse_args()
    if args.micro:
        for rows in args.micro:
            print(json.dumps(micro(rows)))
        return

    import torch

    from asyncengine import LLM
    from workloads import make_workload
    from worker_hooks import runner_of

    llm = LLM(args.model, dtype=args.dtype, **({"num_threads": args.threads} if args.threads else {}))
    reqs = make_workload(args.workload, llm.engine.vocab_size)
    reqs = reqs[:args.limit] if args.limit else reqs
    runner = llm.engine.collective_rpc(runner_of)[0]
    clock = {"execute": 0.0, "sample": 0.0, "head": 0.0}
    real_execute, real_sample, real_head = runner.execute, runner._sample, runner.model.compute_logits

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            clock[name] += time.perf_counter() - t
            return out
        return wrapper

    runner.execute, runner._sample = timed("execute", real_execute), timed("sample", real_sample)
    runner.model.compute_logits = timed("head", real_head)

    def generate(batch):
        prompts = [{"prompt_token_ids": p} for p, _ in batch]
        outs = llm.generate(prompts, [params_for(args.sampling, i, m) for i, (_, m) in enumerate(batch)],
                            use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    vocab = llm.engine.vocab_size
    generate([([3 + (7 * i + j) % (vocab - 3) for j in range(48 + 16 * i)], 8) for i in range(8)])  # warm-up
    for k in clock:
        clock[k] = 0.0
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    n_out = generate(reqs)
    elapsed = time.perf_counter() - t0
    sampler_s = clock["sample"] - clock["head"]
    result = {"sampling": args.sampling, "workload": args.workload, "requests": len(reqs), "dtype": args.dtype,
              "output_tokens": n_out, "elapsed_s": round(elapsed, 3), "output_tok_per_s": round(n_out / elapsed, 1),
              "execute_s": round(clock["execute"], 3), "head_s": round(clock["head"], 3),
              "sampler_s": round(sampler_s, 3), "sampler_share": round(sampler_s / clock["execute"], 4),
              "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2)}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
