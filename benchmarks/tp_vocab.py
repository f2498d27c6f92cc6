#!/usr/bin/env python
"""Tensor parallelism: the embedding and LM head split by vocabulary rows (``tp_vocab_parallel``
True, the default) or replicated on every rank (False), per-step cost side by side.

    python benchmarks/tp_vocab.py --model models/llama-bench --tp 2 --batch 1,32 --steps 40 --repeats 2

Vocab-parallel: each rank embeds its rows and all-reduces ``[tokens, hidden]``, computes ``V/N``
logits per sampled row and gathers them on rank 0. Replicated: no embedding all-reduce, rank 0
computes all ``V`` logits while the other ranks wait for the sampled ids. For each layout (run
alternately, ``--repeats`` times, to spread a shared machine's noise over both) an engine core
with ``tp`` worker processes (``mp``, one thread per rank) times synchronous steps (no overlap, so
a step's time is its cost): decode steps at each batch size (after the prompts are in), and one
prefill step of ``--prefill`` tokens (three times). Reports the median and the minimum ms per step
(the minimum: the least disturbed step on a shared machine) and rank 0's weight bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def measure(core, batch: int, steps: int, prefill: int, vocab: int, tag: str) -> dict:
    from asyncengine.core.request import Request
    from asyncengine.sampling_params import SamplingParams

    def add(rid: str, prompt: list[int], max_tokens: int) -> None:
        core.add_request(Request(request_id=rid, prompt_token_ids=prompt,
                                 sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                 eos_token_ids=frozenset(), max_tokens=max_tokens))

    out = {}
    # decode: `batch` requests with 32-token prompts; their prefills first, then timed decode steps
    for i in range(batch):
        add(f"{tag}-d{batch}-{i}", [3 + (i * 7 + j) % (vocab - 3) for j in range(32)], steps + 4)
    started: set[str] = set()
    while len(started) < batch:  # until every request has its first token: then pure decode steps
        started |= {o.req_id for o in core.step() if o.new_token_ids}
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    while core.has_unfinished():
        core.step()
    out[f"decode_b{batch}_ms"] = statistics.median(times) * 1e3
    out[f"decode_b{batch}_min_ms"] = min(times) * 1e3  # the least disturbed step (a shared machine)
    # prefill: one step of `prefill` prompt tokens (a fresh prompt: no prefix-cache hit)
    if prefill:
        ts = []
        for k in range(3):
            add(f"{tag}-p{batch}-{k}", [3 + (j * 13 + batch + k) % (vocab - 3) for j in range(prefill)], 1)
            t0 = time.perf_counter()
            core.step()
            ts.append(time.perf_counter() - t0)
            while core.has_unfinished():
                core.step()
        out[f"prefill_{prefill}_ms"] = statistics.median(ts) * 1e3
        out[f"prefill_{prefill}_min_ms"] = min(ts) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from asyncengine import EngineConfig
    from asyncengine.engine_core.core import EngineCore

    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    batches = [int(b) for b in args.batch.split(",")]
    runs: dict[str, list[dict]] = {"vocab_parallel": [], "replicated": []}
    for rep in range(args.repeats):
        for layout in runs:
            cfg = EngineConfig(model=args.model, dtype=args.dtype, tensor_parallel_size=args.tp,
                               distributed_executor_backend="mp", num_threads=1, async_scheduling=False,
                               tp_vocab_parallel=layout == "vocab_parallel", max_num_seqs=max(batches),
                               max_num_batched_tokens=max(args.prefill, 64), enable_prefix_caching=False,
                               freeze_gc_after_load=False)
            core = EngineCore(cfg)
            try:
                r = {"weight_bytes_rank0": core.collective_rpc("runner_stats")[0]["weight_bytes"],
                     "load_before": round(os.getloadavg()[0], 2)}
                for b in batches:
                    r.update(measure(core, b, args.steps, args.prefill if b == batches[0] else 0, vocab,
                                     f"{layout}{rep}"))
                r["load_after"] = round(os.getloadavg()[0], 2)
            finally:
                core.shutdown()
            print(json.dumps({"layout": layout, "repeat": rep, **r}), flush=True)
            runs[layout].append(r)
    summary = {layout: {k: round((min if "min" in k else statistics.median)(x[k] for x in rs), 2) for k in rs[0] if k != "load_before"
                        and k != "load_after"} for layout, rs in runs.items()}
    res = {"model": os.path.basename(os.path.normpath(args.model)), "tp": args.tp, "vocab_size": vocab,
           "command": " ".join(sys.argv), "summary": summary, "runs": runs}
    print(json.dumps(res, indent=1))
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
