"""Per-token cost of structured output: the same requests constrained by a JSON schema vs
unconstrained (each unconstrained request decodes exactly as many tokens as its constrained twin
produced), at batch 1 and batch 64, on the default model.

    python benchmarks/structured.py [--model PATH] [--batches 1,64] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import time

from asyncengine import LLM, SamplingParams
from asyncengine.structured import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 80}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "genres": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    "summary": {"type": "string", "maxLength": 300}},
    "required": ["title", "year", "genres", "summary"], "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    # no prefix caching: the second run of the same prompts must not find them cached
    llm = LLM(a.model, dtype=a.dtype, num_threads=a.threads, max_num_seqs=64, kv_cache_bytes=512 << 20,
              enable_prefix_caching=False)
    so = StructuredOutputsParams(json=SCHEMA)
    llm.generate(["warm up"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    for b in map(int, a.batches.split(",")):
        prompts = [[{"role": "user", "content": f"Describe movie number {i} as JSON."}] for i in range(b)]
        cons = [SamplingParams(temperature=0.8, seed=i, max_tokens=a.max_tokens, structured_outputs=so)
                for i in range(b)]
        t0 = time.perf_counter()
        outs = _chat_many(llm, prompts, cons)
        t_cons = time.perf_counter() - t0
        lens = [len(o.outputs[0].token_ids) for o in outs]
        free = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lens)]
        t0 = time.perf_counter()
        outs2 = _chat_many(llm, prompts, free)
        t_free = time.perf_counter() - t0
        assert [len(o.outputs[0].token_ids) for o in outs2] == lens
        n = sum(lens)
        print(f"batch {b:3d}: {n} tokens; unconstrained {t_free / n * 1e3:7.2f} ms/token, "
              f"JSON schema {t_cons / n * 1e3:7.2f} ms/token ({(t_cons / t_free - 1) * 100:+.1f}%)")
    llm.shutdown()


def _chat_many(llm, prompts, params):
    from asyncengine.engine.llm import render_chat

    ids = [{"prompt_token_ids": render_chat(llm.tokenizer, p)} for p in prompts]
    return llm.generate(ids, params, use_tqdm=False)


if __name__ == "__main__":
    main()
