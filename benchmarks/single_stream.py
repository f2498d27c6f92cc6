#!/usr/bin/env python
"""Single-stream decode, as a chat-bot user feels it: one request, a short prompt, N tokens.

    python benchmarks/single_stream.py [--model PATH|default] [--dtype auto] [--tokens 128]
        [--prompt-tokens 32] [--repeat 3] [--threads 2] [--out result.json]

Runs through the public ``AsyncLLMEngine.generate`` (what an embedding app calls), greedy, EOS
ignored. Figures (best and median of --repeat runs after one warm-up run):

  prefill_ms   submit -> first token (the prompt's prefill and the first sample)
  decode_tok_s (tokens - 1) / (last token time - first token time)

The comparison point is ``llama-bench -m GGUF -t 2 -p 32 -n 128`` on the same GGUF file
(``tg128``). Records the CPU model and flags it ran on, since figures only hold per machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time



def cpu_info() -> dict:
    info = {"machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        text = open("/proc/cpuinfo").read()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["model"] = line.split(":", 1)[1].strip()
                break
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        info["simd"] = sorted({f for f in flags.split() if f.startswith(("avx", "amx")) or f == "fma"})
    except OSError:
        pass
    return info


async def one_run(engine, prompt_ids: list[int], tokens: int) -> dict:
    from asyncengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    times = []
    t0 = time.perf_counter()
    async for out in engine.generate({"prompt_token_ids": prompt_ids}, params):
        times.extend([time.perf_counter()] * (len(out.outputs[0].token_ids) - len(times)))
    n = len(times)
    return {"tokens": n, "prefill_ms": (times[0] - t0) * 1e3,
            "decode_tok_s": (n - 1) / (times[-1] - times[0]) if n > 1 else 0.0}


async def amain(args) -> dict:
    import torch

    from asyncengine import AsyncLLMEngine, EngineConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    model = None if args.model == "default" else args.model
    cfg = EngineConfig(model=model, dtype=args.dtype, max_num_seqs=8,
                       **({"num_threads": args.threads} if args.threads else {}),
                       **json.loads(args.engine_options))
    engine = AsyncLLMEngine.from_config(cfg)
    await engine.start()
    try:
        vocab = engine.tokenizer.vocab_size if engine.tokenizer is not None else 1000
        def prompt(run: int) -> list[int]:  # a different prompt each run: no prefix-cache hits
            return [(7 * i + 11 + 131 * run) % min(vocab, 30000) + 100 for i in range(args.prompt_tokens)]

        await one_run(engine, prompt(0), 8)  # warm-up: first-use costs (kernels, caches)
        runs = [await one_run(engine, prompt(r + 1), args.tokens) for r in range(args.repeat)]
    finally:
        await engine.shutdown()
    dec = [r["decode_tok_s"] for r in runs]
    pre = [r["prefill_ms"] for r in runs]
    return {"engine": "asyncengine", "model": args.model, "dtype": str(cfg.torch_dtype),
            "engine_options": json.loads(args.engine_options), "threads": torch.get_num_threads(),
            "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
            "decode_tok_s_best": max(dec), "decode_tok_s_median": statistics.median(dec),
            "prefill_ms_best": min(pre), "prefill_ms_median": statistics.median(pre),
            "prefill_tok_s_best": args.prompt_tokens / min(pre) * 1e3,
            "cpu": cpu_info(), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="a GGUF file, an HF folder, or 'default' (SmolLM2)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's default)")
    ap.add_argument("--engine-options", default="{}", help="JSON of extra EngineConfig fields")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    result = asyncio.run(amain(args))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
