#!/usr/bin/env python
"""Prefix caching on vs off, side by side in one run: throughput and prefill tokens actually computed.

    python benchmarks/prefix_bench.py --model models/llama-bench --workload all --dtype bfloat16 \
        --out /tmp/prefix_bench.json

Workloads (token ids, greedy, EOS ignored, so each request yields exactly its max_tokens):

  shared-prefix  the shared workload of benchmarks/workloads.py: 128 requests of 256 prompt tokens,
                 all starting with the same 192, outputs 32-64, all submitted at once
  multi-turn     16 conversations x 4 turns. Turn 1 is a 96-160 token user message; every later
                 turn resends the whole conversation so far (previous prompt + the model's answer)
                 plus a new 32-96 token user message. Answers are 32-64 tokens. A conversation's
                 turn k+1 is submitted as soon as its turn k finishes, so 16 requests are in flight
                 at a time (seed 7, fixed draw order, like workloads.py)

Both engines share one copy of the weights and run one after the other in this process (in the
order given by --order, default off then on), each after the same warm-up on synthetic prompts
that share nothing with the workload. Reported per engine: elapsed seconds, output and total
(prompt + output) tokens per second, prompt tokens submitted, prompt tokens actually computed
(``num_computed_prompt_tokens`` from ``EngineCore.stats()``: prefix-cache hits excluded,
recomputes after preemption included), the hit rate (tokens), steps, preemptions and evictions.
Outputs of the two engines are compared token for token (bf16: a sanity check, not a parity test).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import machine_info, model_vocab_size  # noqa: E402
from workloads import FIRST_TOKEN, make_workload  # noqa: E402

from asyncengine.config import EngineConfig  # noqa: E402
from asyncengine.engine_core.core import EngineCore  # noqa: E402
from asyncengine.core.request import Request  # noqa: E402
from asyncengine.models.loader import load_model  # noqa: E402
from asyncengine.sampling_params import SamplingParams  # noqa: E402

MULTI_TURN = dict(conversations=16, turns=4, first_len=(96, 160), user_len=(32, 96), answer_len=(32, 64), seed=7)


def multi_turn_plan(vocab_size: int, spec: dict = MULTI_TURN) -> list[list[tuple[list[int], int]]]:
    """Per conversation, per turn: (new user message tokens, answer max_tokens)."""
    rng = random.Random(spec["seed"])
    plan = []
    for _ in range(spec["conversations"]):
        turns = []
        for t in range(spec["turns"]):
            n = rng.randint(*(spec["first_len"] if t == 0 else spec["user_len"]))
            turns.append(([rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(n)], rng.randint(*spec["answer_len"])))
        plan.append(turns)
    return plan


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp, max_tokens=max_tokens)


def step_until_done(core: EngineCore, outs: dict[str, list[int]], on_finish=None) -> None:
    while core.has_unfinished():
        for o in core.step():
            outs[o.req_id].extend(o.new_token_ids)
            if o.finished and on_finish is not None:
                on_finish(o.req_id)


def run_shared_prefix(core: EngineCore, vocab: int) -> tuple[dict, int, int]:
    reqs = make_workload("shared-prefix", vocab)
    outs: dict[str, list[int]] = {}
    for i, (p, m) in enumerate(reqs):
        outs[f"sp{i}"] = []
        core.add_request(make_request(f"sp{i}", p, m))
    step_until_done(core, outs)
    return outs, sum(len(p) for p, _ in reqs), sum(m for _, m in reqs)


def run_multi_turn(core: EngineCore, vocab: int) -> tuple[dict, int, int]:
    plan = multi_turn_plan(vocab)
    outs: dict[str, list[int]] = {}
    history: dict[int, list[int]] = {}  # conversation -> its last prompt
    counts = {"prompt": 0, "output": 0}

    def submit(c: int, t: int) -> None:
        user, m = plan[c][t]
        prompt = (history[c] + outs[f"c{c}t{t - 1}"] if t else []) + user
        history[c] = prompt
        rid = f"c{c}t{t}"
        outs[rid] = []
        counts["prompt"] += len(prompt)
        counts["output"] += m
        core.add_request(make_request(rid, prompt, m))

    def on_finish(rid: str) -> None:
        c, t = (int(x) for x in rid[1:].split("t"))
        if t + 1 < len(plan[c]):
            submit(c, t + 1)

    for c in range(len(plan)):
        submit(c, 0)
    step_until_done(core, outs, on_finish)
    return outs, counts["prompt"], counts["output"]


WORKLOAD_RUNNERS = {"shared-prefix": run_shared_prefix, "multi-turn": run_multi_turn}


def warm_up(core: EngineCore, vocab: int) -> None:
    """A batched prefill and a few batched decodes on prompts that share nothing with the workloads."""
    outs = {}
    for i in range(8):
        rid = f"warm{i}"
        outs[rid] = []
        core.add_request(make_request(rid, [FIRST_TOKEN + (7 * i + 13 * j) % (vocab - FIRST_TOKEN)
                                            for j in range(48 + 16 * i)], 8))
    step_until_done(core, outs)


def bench_one(args, loaded, workload: str, caching: bool) -> dict:
    opts = {k: v for k, v in {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                              "num_threads": args.threads or None}.items() if v is not None}
    config = EngineConfig(model=args.model, dtype=args.dtype, enable_prefix_caching=caching, **opts)
    core = EngineCore(config, loaded)
    vocab = core.vocab_size
    warm_up(core, vocab)
    s0 = core.stats()
    t0 = time.perf_counter()
    outs, prompt_tokens, output_tokens = WORKLOAD_RUNNERS[workload](core, vocab)
    elapsed = time.perf_counter() - t0
    s1 = core.stats()
    got = sum(len(o) for o in outs.values())
    if got != output_tokens:
        raise RuntimeError(f"{workload}: {got} output tokens, expected {output_tokens}")
    d = {k: s1[k] - s0[k] for k in ("num_computed_prompt_tokens", "prefix_cache_queries", "prefix_cache_hits",
                                    "num_steps", "num_scheduled_tokens", "num_preemptions", "num_kv_evictions")}
    result = {
        "prefix_caching": caching,
        "elapsed_s": round(elapsed, 2),
        "output_tok_per_s": round(output_tokens / elapsed, 1),
        "total_tok_per_s": round((prompt_tokens + output_tokens) / elapsed, 1),
        "requests": len(outs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "computed_prompt_tokens": d["num_computed_prompt_tokens"],
        "prefix_hit_rate": (round(d["prefix_cache_hits"] / d["prefix_cache_queries"], 4)
                            if d["prefix_cache_queries"] else 0.0),
        "num_steps": d["num_steps"],
        "mean_scheduled_tokens_per_step": round(d["num_scheduled_tokens"] / max(1, d["num_steps"]), 1),
        "num_preemptions": d["num_preemptions"],
        "num_kv_evictions": d["num_kv_evictions"],
        "config": {"max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
                   "block_size": config.block_size, "num_kv_blocks": core.num_blocks,
                   "dtype": str(config.torch_dtype).removeprefix("torch."), "threads": torch.get_num_threads()},
        "outputs": outs,
    }
    del core
    gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint folder (e.g. models/llama-bench)")
    ap.add_argument("--workload", default="all", choices=sorted(WORKLOAD_RUNNERS) + ["all"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--order", default="off,on", help="engine order per workload, e.g. off,on,on,off")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--out", default="", help="write the JSON report here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(EngineConfig(model=args.model, dtype=args.dtype))
    workloads = sorted(WORKLOAD_RUNNERS) if args.workload == "all" else [args.workload]
    order = [{"on": True, "off": False}[x.strip()] for x in args.order.split(",")]
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "model": os.path.basename(os.path.normpath(args.model)), "dtype": args.dtype,
              "vocab_size": model_vocab_size(args.model), "machine": machine_info(), "workloads": {}}
    for w in workloads:
        runs = []
        for caching in order:
            r = bench_one(args, loaded, w, caching)
            runs.append(r)
            print(f"{w} caching={'on ' if caching else 'off'}: "
                  f"{json.dumps({k: v for k, v in r.items() if k not in ('outputs', 'config')})}", flush=True)
        off = [r for r in runs if not r["prefix_caching"]]
        on = [r for r in runs if r["prefix_caching"]]
        entry = {"runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]}
        if off and on:
            a, b = off[0], on[0]
            same = sum(a["outputs"][k] == b["outputs"][k] for k in a["outputs"])
            entry["summary"] = {
                "speedup_elapsed": round(a["elapsed_s"] / b["elapsed_s"], 2),
                "computed_prompt_tokens_off": a["computed_prompt_tokens"],
                "computed_prompt_tokens_on": b["computed_prompt_tokens"],
                "prefill_saved_frac": round(1 - b["computed_prompt_tokens"] / a["computed_prompt_tokens"], 3),
                "identical_requests": f"{same}/{len(a['outputs'])}",
            }
            print(f"{w}: on vs off {entry['summary']}", flush=True)
        report["workloads"][w] = entry
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
