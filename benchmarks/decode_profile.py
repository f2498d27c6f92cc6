#!/usr/bin/env python
"""Where a single-stream decode step's time goes: the model's forward (per layer), the head and the
sampler, and the runner's own Python, plus (--profile) the torch ops of one forward.

    python benchmarks/decode_profile.py [--model default] [--dtype float32] [--tokens 128]
        [--context 32] [--threads 1] [--attention-backend auto] [--profile] [--repeat 3]

Runs one request through ``LLM.generate`` (greedy, EOS ignored) and times, for each decode step,
``runner.execute`` (the whole step on the worker) and the model's forward inside it. Run it with
``ASYNCENGINE_CPU_KERNELS=0`` for the torch paths (no fused ops, torch attention under auto).
Figures are medians over the decode steps of each of --repeat runs; the best run is reported.
``cpu_*`` figures are the worker thread's CPU time (``time.thread_time``): on a machine shared with
other work they stay close to what the step costs alone, where wall times grow with the load (with
--threads 1 every op runs on that thread).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def linear_cost(model, torch, passes: int = 5) -> float:
    """CPU microseconds per layer of the four projections alone at one token, run through every
    layer in turn as a decode step reads them (weights streamed from memory, not cached): what a
    decode layer would cost with no other op, the floor the rest is measured from."""
    import time as _t

    calls = []
    for layer in model.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            dtype = m.weight.dtype if m.weight is not None else torch.float32  # quantized: fp32 activations
            calls.append((m, torch.randn(1, m.in_features, dtype=dtype)))
    times = []
    with torch.inference_mode():
        for _ in range(passes + 1):
            c = _t.thread_time()
            for m, x in calls:
                m(x)
            times.append(_t.thread_time() - c)
    return statistics.median(times[1:]) * 1e6 / len(model.layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=32, help="prompt tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print the torch ops of one decode forward")
    args = ap.parse_args()

    import torch

    from asyncengine import LLM, SamplingParams
    from worker_hooks import runner_of

    torch.set_num_threads(args.threads)
    llm = LLM(None if args.model == "default" else args.model, dtype=args.dtype, max_num_seqs=1,
              attention_backend=args.attention_backend, num_threads=args.threads)
    runner = llm.engine.collective_rpc(runner_of)[0]
    model = runner.model
    steps: list[float] = []
    fwd: list[float] = []
    cpu_steps: list[float] = []  # the worker thread's CPU time: robust to other processes' load
    cpu_fwd: list[float] = []
    real_execute, real_forward = runner.execute, model.forward

    def execute(so):
        t, c = time.perf_counter(), time.thread_time()
        out = real_execute(so)
        steps.append(time.perf_counter() - t)
        cpu_steps.append(time.thread_time() - c)
        return out

    def forward(*a, **k):
        t, c = time.perf_counter(), time.thread_time()
        out = real_forward(*a, **k)
        fwd.append(time.perf_counter() - t)
        cpu_fwd.append(time.thread_time() - c)
        return out

    runner.execute, model.forward = execute, forward
    prompt = [(7 * i + 11) % 20000 + 100 for i in range(args.context)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    runs = []
    for _ in range(args.repeat):
        for x in (steps, fwd, cpu_steps, cpu_fwd):
            x.clear()
        llm.generate([prompt], sp, use_tqdm=False)
        st, fw, cst, cfw = steps[1:], fwd[1:], cpu_steps[1:], cpu_fwd[1:]  # decode steps (the first: prefill)
        med = statistics.median
        runs.append({"step_ms": med(st) * 1e3, "forward_ms": med(fw) * 1e3,
                     "per_layer_us": med(fw) * 1e6 / model.args.num_layers,
                     "outside_forward_ms": med(s - f for s, f in zip(st, fw)) * 1e3,
                     "cpu_step_ms": med(cst) * 1e3, "cpu_per_layer_us": med(cfw) * 1e6 / model.args.num_layers,
                     "cpu_outside_forward_ms": med(s - f for s, f in zip(cst, cfw)) * 1e3})
    best = min(runs, key=lambda r: r["cpu_step_ms"])
    best["cpu_linear_per_layer_us"] = linear_cost(model, torch)
    best["cpu_rest_per_layer_us"] = best["cpu_per_layer_us"] - best["cpu_linear_per_layer_us"]
    with torch.inference_mode():  # the LM head at one row: part of the step outside the forward
        h = torch.randn(1, model.args.hidden_size).to(llm.config.torch_dtype)
        model.compute_logits(h)
        c = time.thread_time()
        for _ in range(10):
            model.compute_logits(h).float().argmax(-1)
        best["cpu_head_ms"] = (time.thread_time() - c) * 100
    best["cpu_runner_rest_ms"] = best["cpu_outside_forward_ms"] - best["cpu_head_ms"]
    result = {"attention_backend": llm.config.attention_backend_name, "dtype": str(llm.config.torch_dtype),
              "threads": args.threads, "kernels": os.environ.get("ASYNCENGINE_CPU_KERNELS", "1"),
              "layers": model.args.num_layers, "tokens": args.tokens, "context": args.context,
              "decode_tok_s": 1e3 / best["step_ms"], **best, "runs": runs}
    print(json.dumps(result, indent=1))
    if args.profile:  # one decode step under the profiler, on the worker thread that runs it
        from torch.profiler import ProfilerActivity, profile

        tables = []

        def profiled(so):
            if len(steps) != 3:
                return execute(so)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = execute(so)
            tables.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
            return out

        runner.execute = profiled
        steps.clear()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        print(tables[0] if tables else "no step profiled")

if __name__ == "__main__":
    main()
