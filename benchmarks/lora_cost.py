#!/usr/bin/env python
"""What multi-LoRA costs: greedy decode of a batch of 16 requests on the base model, then the same
16 split over 4 PEFT adapters (4 requests each, rank --rank on all seven projections), on one
engine with enable_lora and max_loras=4. Rounds interleave base and adapters (the host is noisy).
Prints JSON (docs/lora.md; the target is within 1.3x): per kind the median, min and max over the
rounds of the batch's wall time per generated token (prefill included), and of the decode step alone
(a run of --max-tokens less a run of 1 token, over the steps between), and the ratios of the medians.

    python benchmarks/make_model.py models/llama-bench
    python benchmarks/lora_cost.py models/llama-bench                        # dense fp32: the torch step
    python benchmarks/lora_cost.py models/llama-bench --quantization int8    # Q8_0: the native C step
"""
from __future__ import annotations

import argparse
import json
import statistics
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


def timed(llm, prompts, params, loras) -> float:
    """Wall seconds of one batch."""
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - t0


def summary(ms: list[float]) -> dict:
    return {"median": round(statistics.median(ms), 2), "min": round(min(ms), 2), "max": round(max(ms), 2)}


def measure(llm, prompts, params, one, kinds: dict, rounds: int) -> dict:
    """Per kind: ms per generated token (wall / max_tokens) and ms per decode step, each round
    running every kind in turn."""
    n = params.max_tokens
    per_token, decode = {k: [] for k in kinds}, {k: [] for k in kinds}
    for _ in range(rounds):
        for k, loras in kinds.items():
            full, first = timed(llm, prompts, params, loras), timed(llm, prompts, one, loras)
            per_token[k].append(full / n * 1e3)
            decode[k].append((full - first) / (n - 1) * 1e3)
    return {k: {"ms_per_token": summary(per_token[k]), "decode_ms_per_step": summary(decode[k])} for k in kinds}


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
    ap.add_argument("--quantization", default=None, help="int8 / int4: block weights (the native decode step)")
    a = ap.parse_args()
    from asyncengine import LLM, LoRARequest, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(a.model, tmp, a.adapters, a.rank)
        llm = LLM(a.model, dtype=a.dtype, enable_lora=True, max_loras=a.adapters, max_lora_rank=a.rank,
                  max_num_seqs=a.batch, enable_prefix_caching=False, quantization=a.quantization)
        prompts = [[(7 * i + j) % 1000 + 3 for j in range(a.prompt_len)] for i in range(a.batch)]
        params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        loras = [LoRARequest(f"a{k}", k + 1, p) for k, p in enumerate(paths)]
        kinds = {"base": None, "lora": [loras[i % a.adapters] for i in range(a.batch)]}
        for loras_k in kinds.values():  # warm-up (and the adapters into host memory)
            timed(llm, prompts, params, loras_k)
        res = measure(llm, prompts, params, one, kinds, a.rounds)
        step = llm.engine.collective_rpc(_native_step)[0]
    ratio = {m: round(res["lora"][m]["median"] / res["base"][m]["median"], 3) for m in res["base"]}
    print(json.dumps({"model": a.model, "batch": a.batch, "adapters": a.adapters, "rank": a.rank,
                      "dtype": a.dtype, "quantization": a.quantization, "decode_step": step,
                      "rounds": a.rounds, **res, "ratio": ratio, "cpu": cpu_info()}))


def _native_step(worker) -> str:
    """Which step decoded: the native one (and with how many adapter steps) or the torch one."""
    step = getattr(worker.model, "native_step", None)
    return "torch" if step is None else f"native ({step.lora_calls} steps with adapter rows)"


if __name__ == "__main__":
    main()
