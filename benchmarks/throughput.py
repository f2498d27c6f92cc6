#!/usr/bin/env python
"""Offline throughput: asyncengine's ``LLM.generate`` against transformers static batching, in one run.

    python benchmarks/throughput.py --model models/llama-bench --workload offline --dtype bfloat16 \
        --baseline hf-static --out /tmp/offline.json

Every engine gets the same token-id prompts (benchmarks/workloads.py), greedy, EOS ignored, so each
request yields exactly its max_tokens. Each engine loads its model and warms up first; only
generation is timed. Output tok/s counts useful tokens (sum of max_tokens); total tok/s adds the
prompt tokens. Engines run one after the other in one invocation, so the ratio is measured under
the same machine conditions (the machine is shared: compare ratios, not absolute numbers across
days).

Each engine runs in a fresh subprocess of this script (``--in-process`` to run them here): no
allocator setting, thread pool or heap state of one engine can help or hurt the other. With
``--repeat N`` the engines alternate N times and the medians are reported. The load average before
and after each run is recorded: on a shared machine it says how much the numbers can be trusted.

Engines (one ``run_<engine>`` function each, registered in ENGINES):
  asyncengine   our LLM.generate, all requests submitted at once (continuous batching)
  hf-static     transformers generate() on chunks of --hf-batch-size requests in order, left
                padding, max_new_tokens = the chunk's max, EOS disabled: the naive baseline
                (a static-batching baseline with transformers, as in the team's peer benchmark, reimplemented here)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import WORKLOADS, make_workload, summary  # noqa: E402


# ------------------------------------------------------------------------------ helpers


def model_vocab_size(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]


def result_dict(engine: str, reqs, outputs, elapsed: float, **extra) -> dict:
    """Common result fields; checks that every request got exactly its max_tokens."""
    bad = [i for i, (o, (_, m)) in enumerate(zip(outputs, reqs)) if len(o) != m]
    if bad or len(outputs) != len(reqs):
        raise RuntimeError(f"{engine}: {len(bad)} requests did not yield exactly max_tokens tokens")
    s = summary(reqs)
    return {
        "engine": engine,
        "elapsed_s": round(elapsed, 3),
        "output_tok_per_s": round(s["output_tokens"] / elapsed, 1),
        "total_tok_per_s": round((s["prompt_tokens"] + s["output_tokens"]) / elapsed, 1),
        **extra,
        "outputs": outputs,  # dropped from the printed summary; used for the agreement figure
    }


# ------------------------------------------------------------------------------ engines


def engine_options(args) -> dict:
    """LLM(...) keyword arguments from the command line (None = the engine's default)."""
    opts = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "num_threads": args.threads or None, "block_size": args.block_size,
            "async_scheduling": args.async_scheduling}
    return {k: v for k, v in opts.items() if v is not None}


def generate_greedy(llm, batch) -> list[list[int]]:
    """``batch``'s (prompt ids, max_tokens) requests through ``llm.generate``, greedy, EOS ignored
    (each yields exactly its max_tokens): the token ids of each."""
    from asyncengine import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in batch]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, detokenize=False) for _, m in batch]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run_asyncengine(args, reqs) -> dict:
    from asyncengine import LLM

    opts = engine_options(args)
    llm = LLM(args.model, dtype=args.dtype, **opts)
    engine = llm.engine

    def generate(batch):
        return generate_greedy(llm, batch)

    # warm-up on synthetic prompts (not workload ones, so the prefix cache cannot reuse them):
    # a batched prefill plus a few batched decode steps
    vocab = engine.vocab_size
    generate([([3 + (7 * i + j) % (vocab - 3) for j in range(48 + 16 * i)], 8) for i in range(8)])

    stats0 = engine.stats()
    exec0 = engine.stats()["executor_busy_s"]
    t0 = time.perf_counter()
    outputs = generate(reqs)
    elapsed = time.perf_counter() - t0
    stats1 = engine.stats()
    steps = stats1["num_steps"] - stats0["num_steps"]
    return result_dict(
        "asyncengine", reqs, outputs, elapsed,
        num_steps=steps,
        num_preemptions=stats1["num_preemptions"] - stats0["num_preemptions"],
        model_execute_s=round(engine.stats()["executor_busy_s"] - exec0, 3),
        config={"max_num_seqs": llm.config.max_num_seqs,
                "max_num_batched_tokens": llm.config.max_num_batched_tokens,
                "block_size": llm.config.block_size, "num_kv_blocks": engine.num_blocks,
                "async_scheduling": llm.config.async_scheduling,
                "prefix_caching": llm.config.enable_prefix_caching,
                "dtype": str(llm.config.torch_dtype).removeprefix("torch."),
                "threads": torch.get_num_threads()})


def run_hf_static(args, reqs) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation="sdpa", local_files_only=True)
    model.eval()
    gc = model.generation_config
    gc.eos_token_id = None  # EOS ignored: no stopping on it, no suppression of its logit
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    pad_id = gc.pad_token_id
    if pad_id is None:
        pad_id = gc.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def generate_chunk(chunk):
        """One generate() for the chunk, left padded; returns each request's first max_tokens new tokens."""
        max_len = max(len(p) for p, _ in chunk)
        max_new = max(m for _, m in chunk)
        ids = torch.full((len(chunk), max_len), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), max_len), dtype=torch.long)
        for i, (p, _) in enumerate(chunk):
            ids[i, max_len - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, max_len - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                 min_new_tokens=None, do_sample=False, eos_token_id=None, pad_token_id=pad_id)
        new = out[:, max_len:].tolist()
        return [row[:m] for row, (_, m) in zip(new, chunk)], max_new * len(chunk)

    generate_chunk([(p, 4) for p, _ in reqs[:2]])  # warm-up

    bs = args.hf_batch_size
    outputs, generated = [], 0
    t0 = time.perf_counter()
    for s in range(0, len(reqs), bs):
        new, n = generate_chunk(reqs[s:s + bs])
        outputs.extend(new)
        generated += n
    elapsed = time.perf_counter() - t0
    return result_dict("hf-static", reqs, outputs, elapsed,
                       generated_tokens=generated,  # includes padding waste past each max_tokens
                       config={"batch_size": bs, "transformers": transformers.__version__,
                               "threads": torch.get_num_threads()})


ENGINES = {"asyncengine": run_asyncengine, "hf-static": run_hf_static}


# ------------------------------------------------------------------------------ main


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two engines' greedy outputs agree: identical requests, and the fraction of tokens
    before the first divergence. In bf16 the engines' rounding differs, so this is a sanity check
    (a broken engine scores near 0), not a parity test: fp32 parity lives in tests/."""
    def common(x, y):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        return k
    same = sum(x == y for x, y in zip(a, b))
    prefix = sum(common(x, y) for x, y in zip(a, b)) / max(1, sum(len(x) for x in a))
    return {"identical_requests": f"{same}/{len(a)}", "common_prefix_frac": round(prefix, 4)}


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


def run_engine(name: str, args, reqs) -> dict:
    """One timed run of engine ``name``: here with --in-process, else in a fresh subprocess."""
    load_before = os.getloadavg()[0]
    if args.in_process:
        r = ENGINES[name](args, reqs)
    else:
        import subprocess
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result.json")
            cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--engine-only", name,
                   "--result-file", path]
            subprocess.run(cmd, check=True)
            with open(path) as f:
                r = json.load(f)
    r["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return r


def median_run(runs: list[dict]) -> dict:
    """The run with the median elapsed time (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r["elapsed_s"])[(len(runs) - 1) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint folder (e.g. models/llama-bench)")
    ap.add_argument("--workload", default="offline", choices=sorted(WORKLOADS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--engine", default="asyncengine", choices=sorted(ENGINES))
    ap.add_argument("--baseline", default="hf-static", choices=sorted(ENGINES) + ["none"],
                    help="engine run after ours, for the ratio ('none' to skip)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N requests (debugging)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    ap.add_argument("--repeat", type=int, default=1, help="alternate the engines this many times")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None, help="KV cache block size (default: the engine's)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="plan step N+1 while step N runs (default: the engine's)")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--in-process", action="store_true", help="run the engines in this process")
    ap.add_argument("--out", default="", help="write the JSON result here")
    ap.add_argument("--engine-only", default="", help=argparse.SUPPRESS)  # internal: the subprocess
    ap.add_argument("--result-file", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    reqs = make_workload(args.workload, model_vocab_size(args.model))
    if args.limit:
        reqs = reqs[:args.limit]

    if args.engine_only:  # a subprocess of the run below: one engine, result to a file
        r = ENGINES[args.engine_only](args, reqs)
        with open(args.result_file, "w") as f:
            json.dump(r, f)
        return

    engines = [args.engine] + ([args.baseline] if args.baseline not in ("none", args.engine) else [])
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for i in range(args.repeat):
        for name in engines:
            r = run_engine(name, args, reqs)
            runs[name].append(r)
            printable = {k: v for k, v in r.items() if k != "outputs"}
            print(f"[{i + 1}/{args.repeat}] {name}: {json.dumps(printable)}", flush=True)
    results = {name: median_run(rs) for name, rs in runs.items()}

    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": os.path.basename(os.path.normpath(args.model)),
        "workload": args.workload, "dtype": args.dtype, **summary(reqs),
        "threads": args.threads or torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "machine": machine_info(),
        "results": {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in results.items()},
        "all_runs": {k: [{kk: vv for kk, vv in r.items() if kk not in ("outputs", "config")} for r in rs]
                     for k, rs in runs.items()},
    }
    if len(engines) == 2:
        ours, base = (results[e] for e in engines)
        report["ratio_output_tok_per_s"] = round(ours["output_tok_per_s"] / base["output_tok_per_s"], 2)
        if args.repeat > 1:  # ratio of each alternating pair, to show the spread
            report["pair_ratios"] = [round(a["output_tok_per_s"] / b["output_tok_per_s"], 2)
                                     for a, b in zip(runs[engines[0]], runs[engines[1]])]
        report["agreement"] = agreement(base["outputs"], ours["outputs"])
        print(f"\n{engines[0]} {ours['output_tok_per_s']:.0f} out tok/s ({ours['elapsed_s']:.1f} s) vs "
              f"{engines[1]} {base['output_tok_per_s']:.0f} out tok/s ({base['elapsed_s']:.1f} s): "
              f"ratio {report['ratio_output_tok_per_s']:.2f}x; outputs agree {report['agreement']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
