#!/usr/bin/env python
"""The Responses API's second turn: time to the first output token when it continues the first by
``previous_response_id`` (the first turn's prompt is in the prefix cache) vs the same conversation
sent whole behind a fresh nonce (nothing cached). Rounds interleave the two; medians with min/max.

    asyncengine serve --port 8000 &
    python benchmarks/responses_turns.py --base-url http://127.0.0.1:8000/v1 --rounds 6

The first turn is ~950 tokens (a 60-line list and a question); each request streams and stops at
its first text delta (greedy, ``max_output_tokens`` 2).
"""
from __future__ import annotations

import argparse
import statistics
import time
import uuid

from openai import OpenAI

DOC = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} box holds {i * 7} stones."
               for i in range(60))


def first_token_s(client: OpenAI, model: str, **kw) -> float:
    t = time.perf_counter()
    for ev in client.responses.create(model=model, stream=True, max_output_tokens=2, temperature=0, **kw):
        if ev.type in ("response.output_text.delta", "response.completed"):
            return time.perf_counter() - t
    raise RuntimeError("the stream ended without output")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    client = OpenAI(base_url=a.base_url, api_key="unused")
    cached, uncached = [], []
    usage = None
    for _ in range(a.rounds):
        question = f"[{uuid.uuid4().hex}] {DOC}\nHow many stones in box 3?"
        first = client.responses.create(model=a.model, input=question, max_output_tokens=8, temperature=0)
        cached.append(first_token_s(client, a.model, previous_response_id=first.id, input="And in box 5?"))
        fresh = [{"role": "user", "content": f"[{uuid.uuid4().hex}] {DOC}\nHow many stones in box 3?"},
                 {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And in box 5?"}]
        uncached.append(first_token_s(client, a.model, input=fresh))
        usage = client.responses.create(model=a.model, previous_response_id=first.id, input="And in box 5?",
                                        max_output_tokens=1).usage

    def show(xs: list[float]) -> str:
        return f"median {statistics.median(xs) * 1e3:.0f} ms (min {min(xs) * 1e3:.0f}, max {max(xs) * 1e3:.0f})"

    print(f"second turn: {usage.input_tokens} input tokens, {usage.input_tokens_details.cached_tokens} cached")
    print("by previous_response_id (cached):", show(cached))
    print("whole, fresh nonce (uncached):   ", show(uncached))


if __name__ == "__main__":
    main()
