"""Pay the first request's one-time costs before a front end says "ready".

A chat's first question took 1.5-3.4 s to its first token where later ones took 0.18-0.38 s
(issue 28; 1.82 s vs 0.20 s on our 2-core EPYC): the first step of each shape builds the math
library's kernels and scratch buffers, the C kernels are loaded, the chat template is compiled, the
KV cache's first pages are touched. :func:`warm_up` runs one short chat request through the whole
public path (template, tokenizer, prefill, decode, sampler, detokenizer), so that all of that
happens before the ready line. Measured with ``benchmarks/startup.py`` (docs/startup.md).
"""
from __future__ import annotations

import time
from asyncengine.errors import InvalidRequestError

# a prompt of the length of a first chat question, so the prefill runs at that size
WARM_UP_MESSAGES = ({"role": "user", "content": "What is the capital of France? Answer in one short sentence."},)
WARM_UP_TOKENS = 4


async def warm_up(engine, tokens: int = WARM_UP_TOKENS) -> float:
    """Run one short greedy chat request on ``engine`` (an AsyncLLMEngine, public API only) and
    drop its answer; returns the seconds it took. The request leaves nothing behind (its blocks are
    freed; with prefix caching their contents may serve a later prompt that begins the same way).
    A context too short for the chat prompt gets a few token ids instead."""

    t0 = time.monotonic()
    if "generate" not in engine.supported_tasks:  # a pooling model (an encoder): one short embedding
        await engine.embed([[min(100, engine.vocab_size - 1)] * min(16, max(1, engine.max_model_len - 1))])
        return time.monotonic() - t0
    try:
        await _run(engine, [dict(m) for m in WARM_UP_MESSAGES], tokens)
    except InvalidRequestError:  # the chat prompt does not fit max_model_len (or no chat template)
        room = max(1, engine.max_model_len - 1)
        length = min(16, max(1, room - tokens))
        await _run(engine, {"prompt_token_ids": [min(100, engine.vocab_size - 1)] * length},
                   max(1, min(tokens, engine.max_model_len - length)))
    return time.monotonic() - t0


async def _run(engine, prompt, tokens: int) -> None:
    from asyncengine import SamplingParams  # lazy: loaded on first use of this rarely used call

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    stream = engine.generate(prompt, params, request_id=f"warm-up-{id(engine):x}")
    try:
        async for _ in stream:
            pass
    finally:
        await stream.aclose()
