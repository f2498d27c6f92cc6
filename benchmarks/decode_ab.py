#!/usr/bin/env python
"""Single-stream decode and prefill, our kernel variants and llama.cpp, in interleaved rounds.

    python benchmarks/decode_ab.py [--model default|PATH.gguf] [--rounds 5] [--tokens 128]
        [--threads 2] [--llama-bench PATH] [--variants native-int8,perop-int8,perop-fp32,native-fp32]
        [--out result.json]

One engine (``AsyncLLMEngine``, what ``asyncengine chat`` runs: one request at a time, greedy, EOS
ignored) is loaded once; each round runs every variant in turn, switched between requests through
the executor (the model's native step on or off, its quantized layers' activation mode), then
``llama-bench -m GGUF -t THREADS -n TOKENS -p 0 -r 1`` (tg) and ``-p 32,512 -n 0 -r 1`` (pp) on the
same file. On a shared, noisy machine only the ratios within a round mean much: the report gives
per variant the median and the spread (min-max) over rounds, and the median of per-round ratios
to llama.cpp.

  decode_tok_s   (tokens - 1) / (last token time - first token time), a 32-token prompt
  cpu_ms_per_token  CPU time (all threads) the process spent per decoded token: on a host shared
                 with other work, the figure its load disturbs least (llama.cpp's: the CPU of a
                 llama-bench run of tokens + 1 minus one of 1 token, over tokens)
  prefill_ms     submit -> first token, 32- and 512-token prompts (llama.cpp: pp32, pp512)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time


VARIANTS = {  # name -> (native step on, activations)
    "native-int8": (True, "int8"), "perop-int8": (False, "int8"),
    "perop-fp32": (False, "fp32"), "native-fp32": (True, "fp32"),
}


def set_variant(worker, native: bool, activations: str) -> bool:
    """On the worker: the native step on/off, every quantized layer's activation mode."""
    from asyncengine.models.llama_native import NativeStep
    from asyncengine.worker.worker import set_quantized_activations

    model = worker.model
    if not hasattr(model, "_ab_native"):
        model._ab_native = model.native_step or NativeStep.for_model(model)
    model.native_step = model._ab_native if native else None
    set_quantized_activations(model, activations)
    return model.native_step is not None


async def one_run(engine, prompt_ids: list[int], tokens: int) -> dict:
    from asyncengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    times: list[float] = []
    cpu: list[float] = []
    t0 = time.perf_counter()
    async for out in engine.generate({"prompt_token_ids": prompt_ids}, params):
        new = len(out.outputs[0].token_ids) - len(times)
        times.extend([time.perf_counter()] * new)
        cpu.extend([time.process_time()] * new)
    n = len(times)
    return {"prefill_ms": (times[0] - t0) * 1e3,
            "decode_tok_s": (n - 1) / (times[-1] - times[0]) if n > 1 else 0.0,
            "cpu_ms_per_token": (cpu[-1] - cpu[0]) / (n - 1) * 1e3 if n > 1 else 0.0}


def _cpu_of(cmd: list[str]) -> float:
    """CPU seconds (user + system, all threads) a child process used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode:
        raise SystemExit(f"{cmd[0]} failed:\n{res.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def llama_bench(binary: str, model: str, threads: int, tokens: int) -> dict:
    base = [binary, "-m", model, "-t", str(threads), "-r", "1", "-p", "0", "-o", "json", "-n"]
    # CPU per generated token: a run of tokens + 1 minus a run of 1 (each warms up with 1 token)
    out = {"cpu_ms_per_token": (_cpu_of(base + [str(tokens + 1)]) - _cpu_of(base + ["1"])) / tokens * 1e3}
    for args in (["-n", str(tokens), "-p", "0"], ["-p", "32,512", "-n", "0"]):
        res = subprocess.run([binary, "-m", model, "-t", str(threads), "-r", "1", "-o", "json", *args],
                             capture_output=True, text=True, timeout=900)
        if res.returncode:
            raise SystemExit(f"llama-bench failed:\n{res.stderr[-2000:]}")
        for row in json.loads(res.stdout):
            key = f"tg{row['n_gen']}" if row["n_gen"] else f"pp{row['n_prompt']}"
            out[key] = row["avg_ts"]
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


async def amain(a) -> dict:
    import torch

    from asyncengine import AsyncLLMEngine, EngineConfig
    from perplexity import gguf_path
    from single_stream import cpu_info

    path = gguf_path(a.model)
    engine = AsyncLLMEngine.from_config(EngineConfig(model=path, num_threads=a.threads, max_num_seqs=1,
                                                     enable_prefix_caching=False))
    await engine.start()
    variants = a.variants.split(",")
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    peer: list[dict] = []
    try:
        core = engine.core
        vocab = engine.tokenizer.vocab_size

        def prompt(n: int, seed: int) -> list[int]:
            return [(7 * i + 11 + 131 * seed) % min(vocab, 30000) + 100 for i in range(n)]

        for v in variants:  # warm-up: first-use costs of each path
            assert core.collective_rpc(set_variant, VARIANTS[v])[0] == VARIANTS[v][0], v
            await one_run(engine, prompt(32, 0), 8)
        for r in range(a.rounds):
            for v in variants:
                core.collective_rpc(set_variant, VARIANTS[v])
                dec = await one_run(engine, prompt(32, 10 * r + 1), a.tokens)
                p512 = await one_run(engine, prompt(512, 10 * r + 2), 1)
                rows[v].append({"decode_tok_s": dec["decode_tok_s"], "cpu_ms_per_token": dec["cpu_ms_per_token"],
                                "prefill32_ms": dec["prefill_ms"], "prefill512_ms": p512["prefill_ms"],
                                "load_avg_1min": os.getloadavg()[0]})
                print(f"round {r} {v}: {rows[v][-1]}", file=sys.stderr, flush=True)
            if a.llama_bench:
                peer.append(llama_bench(a.llama_bench, path, a.threads, a.tokens))
                print(f"round {r} llama.cpp: {peer[-1]}", file=sys.stderr, flush=True)
    finally:
        await engine.shutdown()
    result = {"model": path, "threads": a.threads, "tokens": a.tokens, "rounds": a.rounds, "cpu": cpu_info(),
              "torch_threads": torch.get_num_threads(), "variants": {}, "llama_cpp": {},
              "command": "python benchmarks/decode_ab.py " + " ".join(sys.argv[1:])}
    for v in variants:
        rs = rows[v]
        entry = {k: spread([x[k] for x in rs])
                 for k in ("decode_tok_s", "cpu_ms_per_token", "prefill32_ms", "prefill512_ms", "load_avg_1min")}
        if peer:
            tg = f"tg{a.tokens}"
            entry["decode_vs_llama_tg"] = spread([x["decode_tok_s"] / p[tg] for x, p in zip(rs, peer)])
            entry["cpu_per_token_vs_llama"] = spread([x["cpu_ms_per_token"] / p["cpu_ms_per_token"]
                                                      for x, p in zip(rs, peer)])
            entry["prefill32_vs_llama_pp32"] = spread([(1e3 * 32 / x["prefill32_ms"]) / p["pp32"]
                                                       for x, p in zip(rs, peer)])
            entry["prefill512_vs_llama_pp512"] = spread([(1e3 * 512 / x["prefill512_ms"]) / p["pp512"]
                                                         for x, p in zip(rs, peer)])
        result["variants"][v] = entry
    if peer:
        result["llama_cpp"] = {k: spread([p[k] for p in peer]) for k in peer[0]}
        result["llama_bench"] = a.llama_bench
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--variants", default="native-int8,perop-int8,perop-fp32,native-fp32")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    result = asyncio.run(amain(a))
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
