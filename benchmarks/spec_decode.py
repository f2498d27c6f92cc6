"""Single-stream decode with n-gram speculation vs none, on a workload where the answer repeats the
prompt (rewrite / edit a given text): tokens/s of each, the speedup, and the acceptance rate.

    python benchmarks/spec_decode.py [--model PATH] [--k 4] [--max-tokens 256] [--repeats 2]

Default model: the cached default GGUF (SmolLM2-135M-Instruct), greedy. Both runs must produce the
same tokens (greedy speculation is exact); the script checks it.
"""
from __future__ import annotations

import argparse
import time

from asyncengine import LLM, SamplingParams

TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long "
        "discussion, the members agreed to increase funding for the public library by ten percent, "
        "to repair the roof of the community center before winter, and to hire two additional staff "
        "members for the parks department. The proposal to build a new parking garage downtown was "
        "postponed until the spring, when more information about the costs will be available. The "
        "next meeting will take place on the first Monday of next month at the town hall.")
TASKS = [
    "Rewrite the following text exactly, but replace every occurrence of 'committee' with 'council':\n\n",
    "Copy the following text, correcting nothing and changing nothing except 'Tuesday' to 'Wednesday':\n\n",
]


def run(llm: LLM, max_tokens: int, repeats: int) -> tuple[float, list[list[int]], dict]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    toks, outs = 0, []
    t0 = time.perf_counter()
    for _ in range(repeats):
        for task in TASKS:
            o = llm.chat([{"role": "user", "content": task + TEXT}], params, use_tqdm=False)[0]
            outs.append(list(o.outputs[0].token_ids))
            toks += len(o.outputs[0].token_ids)
    dt = time.perf_counter() - t0
    return toks / dt, outs, llm.engine.stats()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    common = dict(dtype=a.dtype, num_threads=a.threads, max_num_seqs=4, kv_cache_bytes=256 << 20)
    base = LLM(a.model, **common)
    run(base, 16, 1)  # warm-up
    tps0, outs0, _ = run(base, a.max_tokens, a.repeats)
    base.shutdown()
    spec = LLM(a.model, speculative_config={"method": "ngram", "num_speculative_tokens": a.k,
                                            "prompt_lookup_min": 1, "prompt_lookup_max": a.lookup_max}, **common)
    run(spec, 16, 1)
    tps1, outs1, s = run(spec, a.max_tokens, a.repeats)
    spec.shutdown()
    same = outs0 == outs1
    print(f"no speculation : {tps0:7.1f} tokens/s")
    print(f"ngram k={a.k}     : {tps1:7.1f} tokens/s  ({tps1 / tps0:.2f}x)")
    print(f"acceptance rate {s['spec_acceptance_rate']:.2f}, mean accepted length "
          f"{s['spec_mean_accepted_length']:.2f} tokens/step, outputs identical: {same}")


if __name__ == "__main__":
    main()
