#!/usr/bin/env python
"""What multi-LoRA costs: greedy decode of a batch of 16 requests on the base model, then the same
16 split over 4 PEFT adapters (4 requests each, rank --rank on all seven projections), on one
engine with enable_lora and max_loras=4. Prints JSON: the mean decode step time of each and their
ratio (docs/lora.md; the target is within 1.3x).

    python benchmarks/make_model.py models/llama-bench
    python benchmarks/lora_cost.py models/llama-bench
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

from single_stream import cpu_info  # the CPU model and SIMD flags, as every benchmark records them


def make_adapters(model_dir: str, out: str, n: int, rank: int) -> list[str]:
    import peft
    import torch
    import transformers

    paths = []
    for k in range(n):
        torch.manual_seed(k)
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        path = f"{out}/adapter{k}"
        peft.get_peft_model(base, cfg).save_pretrained(path)
        paths.append(path)
    return paths


def timed(llm, prompts, params, loras, rounds: int) -> float:
    """Seconds per generated token step (wall time of the batch / max_tokens), best of ``rounds``."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        best = min(best, time.perf_counter() - t0)
    return best / params.max_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    from asyncengine import LLM, LoRARequest, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(a.model, tmp, a.adapters, a.rank)
        llm = LLM(a.model, dtype=a.dtype, enable_lora=True, max_loras=a.adapters, max_lora_rank=a.rank,
                  max_num_seqs=a.batch, enable_prefix_caching=False)
        prompts = [[(7 * i + j) % 1000 + 3 for j in range(a.prompt_len)] for i in range(a.batch)]
        params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
        loras = [LoRARequest(f"a{k}", k + 1, p) for k, p in enumerate(paths)]
        mixed = [loras[i % a.adapters] for i in range(a.batch)]
        timed(llm, prompts, params, None, 1)  # warm-up (and the adapters into host memory)
        timed(llm, prompts, params, mixed, 1)
        base_s = timed(llm, prompts, params, None, a.rounds)
        lora_s = timed(llm, prompts, params, mixed, a.rounds)
    print(json.dumps({"model": a.model, "batch": a.batch, "adapters": a.adapters, "rank": a.rank,
                      "dtype": a.dtype, "base_ms_per_step": round(base_s * 1e3, 2),
                      "lora_ms_per_step": round(lora_s * 1e3, 2), "ratio": round(lora_s / base_s, 2),
                      "cpu": cpu_info()}))


if __name__ == "__main__":
    main()
