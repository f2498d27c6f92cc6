#!/usr/bin/env python
"""Decode at a long context with the 8-bit KV cache against the 16/32-bit ones, in interleaved rounds.

    python benchmarks/kv_cache_int8.py [--model default|PATH] [--context 8192] [--tokens 32]
        [--rounds 3] [--threads 2] [--variants fp32,bf16,int8] [--out result.json]

Variants (one engine each, loaded once; greedy, EOS ignored, one sequence):
  fp32   the default GGUF's cache: fp32 activations, fp32 KV (the native decode step)
  bf16   a 16-bit cache: dtype bfloat16 (activations too; the per-op step)
  int8   kv_cache_dtype="int8" with fp32 activations (the native decode step, attention_i8.c)
  int8-bf16  kv_cache_dtype="int8" with dtype bfloat16 (the per-op step: the bf16 variant's twin)

Method: the prompt (``--context`` random token ids) is prefilled once per engine and stays in the
prefix cache; each round then runs, per variant, a request for ``1 + --tokens`` tokens of the same
prompt (a cache hit: only its last block is recomputed), and the decode time per token is
(last token time - first token time) / --tokens, from the request's own metrics. Medians over
rounds; the machine is shared, so read the ratios of a round (also given, median over rounds).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

VARIANTS = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"),
            "int8": dict(dtype="float32", kv_cache_dtype="int8"),
            "int8-bf16": dict(dtype="bfloat16", kv_cache_dtype="int8")}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timed(llm, prompt: list[int], n: int) -> tuple[float, float]:
    """(wall seconds of the request, its decode seconds per token from the engine's own token times)."""
    from asyncengine import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    per_token = (m.last_token_time - m.first_token_time) / (n - 1) if n > 1 and m is not None else 0.0
    return time.perf_counter() - t0, per_token


def main() -> None:
    from asyncengine import LLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="fp32,bf16,int8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    names = a.variants.split(",")
    prompt = [random.Random(0).randrange(100, 40000) for _ in range(a.context - a.tokens - 2)]
    engines, prefill_s, blocks = {}, {}, {}
    for name in names:
        llm = LLM(a.model, num_threads=a.threads, max_num_seqs=1, max_model_len=a.context,
                  skip_tokenizer_init=True, **VARIANTS[name])
        prefill_s[name] = timed(llm, prompt, 1)[0]  # the prompt into the prefix cache
        blocks[name] = llm.engine.stats()["num_kv_blocks"]
        engines[name] = llm
    per_token = {n: [] for n in names}
    for _ in range(a.rounds):
        for name in names:
            llm = engines[name]
            per_token[name].append(timed(llm, prompt, 1 + a.tokens)[1])
    base = names[0]
    result = {"cpu": cpu_name(), "threads": a.threads, "model": a.model, "context": a.context, "tokens": a.tokens,
              "rounds": a.rounds, "variants": {}}
    for name in names:
        ms = [t * 1e3 for t in per_token[name]]
        result["variants"][name] = {
            **VARIANTS[name], "decode_ms_per_token_median": statistics.median(ms), "decode_ms_per_token": ms,
            "decode_tok_s": 1e3 / statistics.median(ms), "prefill_s": prefill_s[name], "num_kv_blocks": blocks[name],
            f"speedup_vs_{base}_median": statistics.median(b / t for b, t in zip(per_token[base], per_token[name]))}
    for llm in engines.values():
        llm.shutdown()
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
