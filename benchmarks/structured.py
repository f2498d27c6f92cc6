"""Per-token cost of structured output: the same requests constrained by a JSON schema vs
unconstrained (each unconstrained request decodes exactly as many tokens as its constrained twin
produced), at batch 1 and batch 64, on the default model. Runs alternate (free, JSON, free, JSON)
and the best of each is kept; the runner's own clock of its grammar work (masks, matchers) is
reported too, which a busy machine does not distort the way it distorts whole-run timings.

    python benchmarks/structured.py [--model PATH] [--batches 1,64] [--max-tokens 48]
"""
from __future__ import annotations

import argparse
import time

from asyncengine import LLM, SamplingParams
from asyncengine.engine.llm import render_chat
from asyncengine.structured import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 80}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "genres": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    "summary": {"type": "string", "maxLength": 300}},
    "required": ["title", "year", "genres", "summary"], "additionalProperties": False}


def timed(llm, prompts, params):
    g0 = llm.engine.collective_rpc("runner_stats")[0]["grammar_time_s"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return outs, dt, llm.engine.collective_rpc("runner_stats")[0]["grammar_time_s"] - g0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    # no prefix caching: the second run of the same prompts must not find them cached
    llm = LLM(a.model, dtype=a.dtype, num_threads=a.threads, max_num_seqs=64, kv_cache_bytes=512 << 20,
              enable_prefix_caching=False)
    so = StructuredOutputsParams(json=SCHEMA)
    llm.generate(["warm up"] * 2, SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    for b in map(int, a.batches.split(",")):
        prompts = [{"prompt_token_ids": render_chat(llm.tokenizer, [
            {"role": "user", "content": f"Describe movie number {i} as JSON."}])} for i in range(b)]
        cons = [SamplingParams(temperature=0.8, seed=i, max_tokens=a.max_tokens, structured_outputs=so)
                for i in range(b)]
        outs, _, _ = timed(llm, prompts, cons)
        lens = [len(o.outputs[0].token_ids) for o in outs]
        free = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lens)]
        best_free = best_cons = float("inf")
        gtime = 0.0
        for _ in range(a.repeats):
            _, dt, _ = timed(llm, prompts, free)
            best_free = min(best_free, dt)
            _, dt, g = timed(llm, prompts, cons)
            if dt < best_cons:
                best_cons, gtime = dt, g
        n = sum(lens)
        print(f"batch {b:3d}: {n} tokens; unconstrained {best_free / n * 1e3:7.2f} ms/token, JSON schema "
              f"{best_cons / n * 1e3:7.2f} ms/token ({(best_cons / best_free - 1) * 100:+.1f}%); grammar work "
              f"{gtime / n * 1e3:.3f} ms/token = {gtime / best_cons * 100:.1f}% of the constrained run")
    llm.shutdown()


if __name__ == "__main__":
    main()
