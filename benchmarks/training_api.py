"""The trainer API's figures for docs/training.md: update_weights time, sleep/wake RSS and time,
and the largest |sampled - scored| logprob difference in the default mode (fp32 and bf16).

    python benchmarks/training_api.py

Models are random Llamas written to a temporary folder: "tiny" (hidden 64, 2 layers, vocab 512)
and "wide" (hidden 1024, 2 layers, vocab 16384: ~300 MiB of fp32 weights). Times are medians of 3.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from safetensors.torch import load_file  # noqa: E402

from asyncengine import LLM, SamplingParams  # noqa: E402
from asyncengine.worker.sleep_mode import rss_bytes  # noqa: E402
from model_utils import make_tiny_checkpoint  # noqa: E402

WIDE = dict(hidden_size=1024, intermediate_size=2048, vocab_size=16384, num_attention_heads=8, num_key_value_heads=4)
COMMON = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=256, num_threads=1)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def update_times(a: str, b: str) -> dict:
    out = {}
    with LLM(a, num_kv_blocks=64, **COMMON) as llm:
        sd = {"A": load_file(f"{a}/model.safetensors"), "B": load_file(f"{b}/model.safetensors")}
        out["update_weights(state_dict)"] = statistics.median(
            timed(lambda k=k: llm.update_weights(sd[k])) for k in ("B", "A", "B"))
        out["update_weights(path)"] = statistics.median(timed(lambda p=p: llm.update_weights(p)) for p in (a, b, a))
        sleep2, wake2 = [], []
        for _ in range(3):
            sleep2.append(timed(lambda: llm.sleep(2)))
            wake2.append(timed(llm.wake_up))
        out["sleep(2)"], out["wake_up() from the checkpoint"] = statistics.median(sleep2), statistics.median(wake2)
    return out


def sleep_rss(tiny: str) -> dict:
    with LLM(tiny, kv_cache_bytes=2 << 30, **COMMON) as llm:
        runner = llm.engine.executor.worker.runner
        kv = sum(t.numel() * t.element_size() for pair in runner.kv_caches for t in pair)
        for pair in runner.kv_caches:
            for t in pair:
                t.zero_()  # resident, as after long prompts
        del pair, t, runner
        rss = rss_bytes()
        s = timed(lambda: llm.sleep(1))
        freed = rss - rss_bytes()
        w = timed(llm.wake_up)
    return {"kv_gib": kv / 2**30, "freed_gib": freed / 2**30, "sleep(1)": s, "wake_up() (2 GiB KV)": w}


def score_gap(tiny: str, dtype: str) -> float:
    import random

    rng = random.Random(0)
    with LLM(tiny, **{**COMMON, "dtype": dtype}, num_kv_blocks=256, max_num_batched_tokens=16, seed=0) as llm:
        ps = [[rng.randrange(3, 512) for _ in range(rng.randrange(3, 40))] for _ in range(32)]
        outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                            [SamplingParams(max_tokens=12, temperature=1.0, seed=i, logprobs=0) for i in range(32)],
                            use_tqdm=False)
        comps = [o.outputs[0] for o in outs]
        scores = llm.score(ps, [c.token_ids for c in comps])
    return max(abs(lp[t].logprob - s) for c, sc in zip(comps, scores) for lp, t, s in zip(c.logprobs, c.token_ids, sc))


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        tiny = make_tiny_checkpoint(f"{d}/tiny", "llama")
        a = make_tiny_checkpoint(f"{d}/a", "llama", seed=0, **WIDE)
        b = make_tiny_checkpoint(f"{d}/b", "llama", seed=1, **WIDE)
        for k, v in update_times(a, b).items():
            print(f"wide  {k:32s} {v * 1000:8.0f} ms")
        r = sleep_rss(tiny)
        print(f"tiny  sleep(1): KV {r['kv_gib']:.2f} GiB, RSS down {r['freed_gib']:.2f} GiB; "
              f"sleep {r['sleep(1)'] * 1000:.0f} ms, wake {r['wake_up() (2 GiB KV)'] * 1000:.0f} ms")
        for dtype in ("float32", "bfloat16"):
            print(f"tiny  default mode, {dtype}: largest |sampled - scored| logprob {score_gap(tiny, dtype):.3g}")


if __name__ == "__main__":
    main()
