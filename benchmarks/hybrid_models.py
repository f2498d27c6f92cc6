#!/usr/bin/env python
"""A hybrid (Mamba2 + attention) model next to a pure-attention one of about the same size.

    python benchmarks/hybrid_models.py --out benchmarks/results/hybrid_models.json

Two random-weight checkpoints are made in --models (nothing is downloaded), both hidden 512,
8 layers, vocabulary 32000, max_position_embeddings 16384:

  llama   the benchmark Llama (8 query / 4 KV heads of 64, MLP 1408): every layer attention
  bamba   BambaForCausalLM with the same attention and MLP, but 7 of its 8 token mixers are Mamba2
          (8 heads of 64 = expand 1, 1 group, state 64, conv 4, chunk 256: about the weights of an
          attention layer, so the two models differ by <1% in parameters); attention only in
          layer 4, the 1-in-8 mix of Granite 4.0 H / Nemotron-H

Measurements alternate the two models (A, B, A, B, ...) over --rounds rounds; medians with the
min-max spread. Besides wall-clock rates, the process CPU time is recorded: on a host that other
processes load, CPU time per token moves much less than wall time (default 1 torch thread, so
CPU time is the work done).

  decode     one request per model alone (max_num_seqs 1): a prompt of C tokens (C = 512 ... 8192)
             is prefilled, then the two requests decode in alternating blocks of --decode-tokens
             single-token steps (one block per model per round, the prefill excluded). The
             attention layers read the whole context every step; the Mamba layers a fixed state.
  prefix     the shared-prefix workload of benchmarks/workloads.py (128 requests of 256 prompt
             tokens sharing 192, outputs 32-64, all at once), each model with prefix caching on and
             off: elapsed, output tok/s, prompt tokens actually computed. For the hybrid, "on" is
             refused (off with a log line: docs/hybrid_models.md says why), so its two runs are the
             same engine configuration: their difference is the noise. --prefix-rounds rounds.

The host is shared: figures move with other processes' load; the JSON keeps every sample.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import make_workload, summary  # noqa: E402

COMMON = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=16384, bos_token_id=0, eos_token_id=1, pad_token_id=2,
              tie_word_embeddings=False)
MAMBA = dict(attn_layer_indices=[4], mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64,
             mamba_d_conv=4, mamba_chunk_size=256, mamba_expand=1)


def make_checkpoint(out: str, arch: str) -> int:
    """A random-weight checkpoint (2-D weights N(0, 1/fan_in): logits far from uniform). Returns
    the parameter count."""
    import transformers

    if os.path.exists(os.path.join(out, "config.json")):
        return json.load(open(os.path.join(out, "params.json")))["params"]
    cfg = (transformers.LlamaConfig(**COMMON) if arch == "llama"
           else transformers.BambaConfig(**COMMON, **MAMBA))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in n:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    json.dump({"params": params}, open(os.path.join(out, "params.json"), "w"))
    return params


def greedy(n: int):
    from asyncengine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def start(llm, context: int, total_tokens: int) -> dict:
    """Submit one request of ``context`` random prompt tokens and run its prefill (in chunks) up to
    its first token."""
    import random

    from asyncengine.core.request import Request

    core = llm.engine
    rng = random.Random(context)
    prompt = [rng.randrange(3, 32000) for _ in range(context)]
    core.add_request(Request(f"ctx{context}", prompt, greedy(total_tokens), eos_token_ids=set(),
                             max_tokens=total_tokens))
    w0, c0 = time.perf_counter(), time.process_time()
    while not core.step():
        pass
    return {"prefill_s": time.perf_counter() - w0, "prefill_cpu_s": time.process_time() - c0}


def decode_block(llm, steps: int) -> dict:
    """``steps`` single-token decode steps of the running request: wall and process CPU time."""
    core = llm.engine
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        core.step()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return {"decode_tok_s": steps / wall, "cpu_ms_per_token": 1e3 * cpu / steps}


def finish(llm) -> None:
    core = llm.engine
    core.abort_requests(list(core.scheduler.requests))
    core.step()


def shared_prefix(llm, requests) -> dict:
    before = llm.engine.stats()["num_computed_prompt_tokens"]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p, _ in requests], [greedy(m) for _, m in requests], use_tqdm=False)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_s": dt, "output_tok_s": out_tokens / dt, "cpu_s": cpu,
            "computed_prompt_tokens": llm.engine.stats()["num_computed_prompt_tokens"] - before}


def med(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models/hybrid-bench", help="folder for the two checkpoints")
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192")
    ap.add_argument("--decode-tokens", type=int, default=32, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefix-rounds", type=int, default=2, help="rounds of the shared-prefix workload")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip", choices=["decode", "prefix"], default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from asyncengine import LLM

    dirs = {arch: os.path.join(a.models, arch) for arch in ("llama", "bamba")}
    params = {arch: make_checkpoint(d, arch) for arch, d in dirs.items()}
    contexts = [int(c) for c in a.contexts.split(",")]
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "threads": a.threads, "dtype": a.dtype, "params": params,
              "command": "python " + " ".join(sys.argv), "note": "shared host: other processes ran meanwhile"}

    if a.skip != "decode":
        engines = {arch: LLM(d, dtype=a.dtype, max_num_seqs=1, max_model_len=max(contexts) + a.rounds * a.decode_tokens + 16,
                             max_num_batched_tokens=2048, enable_prefix_caching=False, num_threads=a.threads)
                   for arch, d in dirs.items()}
        for llm in engines.values():  # warm-up
            start(llm, 64, 8)
            decode_block(llm, 4)
            finish(llm)
        samples = {arch: {} for arch in engines}
        for c in contexts:
            for arch, llm in engines.items():
                samples[arch][c] = {"prefill": start(llm, c, a.rounds * a.decode_tokens + 2), "decode": []}
            for r in range(a.rounds):  # the same two requests, decoding in alternating blocks
                for arch, llm in engines.items():
                    s = decode_block(llm, a.decode_tokens)
                    samples[arch][c]["decode"].append(s)
                    print(f"round {r} context {c:5d} {arch:5s}: {s['decode_tok_s']:7.1f} decode tok/s, "
                          f"{s['cpu_ms_per_token']:6.1f} CPU ms/token", flush=True)
            for llm in engines.values():
                finish(llm)
        result["decode"] = {arch: {str(c): {
            "decode_tok_s": med([s["decode_tok_s"] for s in v["decode"]]),
            "cpu_ms_per_token": med([s["cpu_ms_per_token"] for s in v["decode"]]),
            "prefill_s": v["prefill"]["prefill_s"], "prefill_cpu_s": v["prefill"]["prefill_cpu_s"],
            "samples": v["decode"]} for c, v in per.items()} for arch, per in samples.items()}
        del engines

    if a.skip != "prefix":
        requests = make_workload("shared-prefix", 32000)
        result["prefix_workload"] = summary(requests)
        configs = [(arch, on) for arch in dirs for on in (True, False)]
        engines = {(arch, on): LLM(dirs[arch], dtype=a.dtype, enable_prefix_caching=on, max_model_len=1024,
                                   num_threads=a.threads) for arch, on in configs}
        for llm in engines.values():
            llm.generate([[5 + i] * 40 for i in range(4)], [greedy(4)] * 4, use_tqdm=False)
        runs = {k: [] for k in configs}
        for r in range(a.prefix_rounds):
            for k in configs:
                s = shared_prefix(engines[k], requests)
                runs[k].append(s)
                print(f"round {r} shared-prefix {k[0]:5s} prefix caching {'on ' if k[1] else 'off'}: "
                      f"{s['output_tok_s']:7.1f} out tok/s, {s['cpu_s']:.1f} CPU s, "
                      f"{s['computed_prompt_tokens']} prompt tokens computed",
                      flush=True)
        result["shared_prefix"] = {f"{arch}/prefix_caching_{'on' if on else 'off'}": {
            "output_tok_s": med([s["output_tok_s"] for s in v]), "elapsed_s": med([s["elapsed_s"] for s in v]),
            "cpu_s": med([s["cpu_s"] for s in v]),
            "computed_prompt_tokens": v[-1]["computed_prompt_tokens"], "samples": v} for (arch, on), v in runs.items()}

    text = json.dumps(result, indent=1)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("decode", "shared_prefix")}, indent=1))


if __name__ == "__main__":
    main()
