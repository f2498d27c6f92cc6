#!/usr/bin/env python
"""The models of wave 4 on a CUDA machine: greedy parity with transformers, each architecture a row.

    python benchmarks/gpu_models.py --json gpu_models.json   # on the GPU machine, repository root
    python benchmarks/gpu_models.py --device cpu             # anywhere: the same rows on CPU

gpu_check.py covers the Llama path (kernels, graphs, the offline workload); this covers what the
CPU suite checks for the newer models (Gemma 2/3 soft-caps and windows, Phi-3 LongRoPE, the MoE
layers, the Transformers backend, LoRA) on the device they will meet in production. Each row: a tiny
random-weight checkpoint (tests/model_utils.py's shapes), 8 requests greedy in fp32 through `LLM`
with the device's default attention backend, in two regimes (a plain batch; chunked prefill of 16
tokens with a cache small enough to preempt), compared with transformers fp32 on the CPU under the
suite's rule (token-exact, a first divergence excused only at a reference near-tie), the reference
on transformers' eager attention. Then decode
speed for the same models in bf16, batch 8. A failure is a row, never a crash.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (REPO / "tests", REPO / "tests" / "lora"):
    sys.path.insert(0, str(p))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from asyncengine import LLM, LoRARequest, SamplingParams  # noqa: E402
from model_utils import compare, hf_greedy, make_tiny_checkpoint, random_requests  # noqa: E402

ARCHS = ["llama", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "olmo2"]
REGIMES = {
    "batch": dict(),
    "chunked16+small cache": dict(max_num_batched_tokens=16, num_kv_blocks=24, block_size=8, max_num_seqs=8),
}
ROWS: list[dict] = []


def row(model: str, what: str, value, ok: bool = True, note: str = "") -> None:
    ROWS.append(dict(model=model, what=what, value=value, ok=ok, note=note))
    print(f"{'  ' if ok else '!!'} {model:<12} {what:<28} {value} {note}", flush=True)


def run_engine(model_dir: str, requests, device: str, dtype: str, lora=None, **options):
    llm = LLM(model_dir, dtype=dtype, device=device, **options)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in requests]
    t0 = time.perf_counter()
    outs = llm.generate([list(p) for p, _ in requests], params, use_tqdm=False,
                        **({"lora_request": [lora] * len(requests)} if lora else {}))
    dt = time.perf_counter() - t0
    del llm
    return [o.outputs[0].token_ids for o in outs], dt


def parity(name: str, model_dir: str, ref_dir: str, device: str, lora=None, **extra) -> None:
    requests = random_requests(8, 512, seed=3, plen=(5, 40), olen=(4, 16))
    refs = hf_greedy(ref_dir, requests, attn_implementation="eager")  # the device's transformers may
    # default to sdpa where it drops part of the model's math (5.17: Gemma 2's attention soft-cap)
    for regime, options in REGIMES.items():
        try:
            got, _ = run_engine(model_dir, requests, device, "float32", lora=lora, **options, **extra)
            c = compare(got, refs)
            row(name, f"fp32 parity, {regime}", f"{c['exact']} exact + {c['near_tie']} near-tie / {c['total']}")
        except Exception as e:  # noqa: BLE001 - a failure is a row
            row(name, f"fp32 parity, {regime}", f"{type(e).__name__}: {str(e)[:160]}", ok=False)
            traceback.print_exc()


def speed(name: str, model_dir: str, device: str, **extra) -> None:
    requests = random_requests(8, 512, seed=4, plen=(32, 32), olen=(64, 64))
    try:
        run_engine(model_dir, requests[:2], device, "bfloat16", **extra)  # warm-up (compile, graphs)
        _, dt = run_engine(model_dir, requests, device, "bfloat16", **extra)
        row(name, "bf16 batch 8, 64 out", f"{8 * 64 / dt:.0f} tok/s")
    except Exception as e:  # noqa: BLE001
        row(name, "bf16 batch 8, 64 out", f"{type(e).__name__}: {str(e)[:160]}", ok=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {name}; torch {torch.__version__}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="gpu_models_"))
    for arch in args.archs.split(","):
        try:
            d = make_tiny_checkpoint(str(root / arch), arch)
        except Exception as e:  # noqa: BLE001
            row(arch, "checkpoint", f"{type(e).__name__}: {e}", ok=False)
            continue
        extra = {"model_impl": "transformers"} if arch == "olmo2" else {}
        parity(arch, d, d, args.device, **extra)
        speed(arch, d, args.device, **extra)
    try:  # LoRA: the base model plus an adapter, against PEFT's merged weights
        from lora_utils import make_adapter, merged_model_dir

        base = str(root / "llama")
        if not (root / "llama").exists():
            make_tiny_checkpoint(base, "llama")
        adapter = make_adapter(base, str(root / "a16"), "a16")
        merged = merged_model_dir(base, adapter, str(root / "merged"))
        parity("llama+lora", base, merged, args.device, lora=LoRARequest("a16", 1, adapter),
               enable_lora=True, max_lora_rank=16)
    except Exception as e:  # noqa: BLE001
        row("llama+lora", "setup", f"{type(e).__name__}: {e}", ok=False)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=name, rows=ROWS), indent=1))
    return 0 if all(r["ok"] for r in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
