#!/usr/bin/env python
"""Where a single-stream decode token of a GGUF goes, in CPU time: robust on a shared host.

    python benchmarks/decode_kernels.py [--model default|PATH.gguf] [--rounds 7] [--out result.json]

One thread (CPU time of the calling thread, ``time.thread_time``: other processes' load slows the
wall clock, much less the work a thread does), interleaved rounds, medians with min-max:

  projections   the 4 block-quantized projections of every layer (distinct weights per layer, so
                they stream from memory as in decode), M = 1, per int8 ISA and weight layout (x8:
                repacked at load, the int8 default; rows: the file's) and fp32 activations: ms per
                token and the GB/s of weight bytes that makes (each of the 120 calls also pays ~6 us
                of Python: the step below has none)
  head          the tied Q8_0 LM head, M = 1
  step          one decode step of the real model at a 100-token context (layers + final norm,
                then the head): the native step against the per-op model, int8 and fp32
  read_gb_s     torch.sum over 1 GiB on one thread: the read bandwidth the projections compare to
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time



def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def cpu_ms(f, reps: int = 1) -> float:
    t = time.thread_time()
    for _ in range(reps):
        f()
    return (time.thread_time() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import torch

    from asyncengine.attention import SeqChunk, StepBatch, get_backend
    from asyncengine.config import EngineConfig
    from asyncengine.kernels.cpu import quant
    from asyncengine.models.llama_native import NativeStep
    from asyncengine.models.loader import load_model
    from asyncengine.worker.worker import set_quantized_activations
    from perplexity import gguf_path
    from single_stream import cpu_info

    torch.set_num_threads(1)
    model = load_model(EngineConfig(model=gguf_path(a.model), dtype="float32"), tokenizer=False).model
    args = model.args
    layers = [(l.self_attn.qkv_proj, l.self_attn.o_proj, l.mlp.gate_up_proj, l.mlp.down_proj) for l in model.layers]
    proj_bytes = sum(lin.qweight.numel() for ls in layers for lin in ls)
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    xs = {lin.in_features: torch.randn(1, lin.in_features) for lin in layers[0]}
    hx = torch.randn(1, args.hidden_size)

    def projections(act):
        for ls in layers:
            for lin in ls:
                quant.gemm(xs[lin.in_features], lin.qweight, lin.qtype, lin.in_features, activations=act,
                           packed=lin.packed)

    backend = get_backend("cpu", num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                          head_dim=args.head_dim, block_size=16, num_blocks=16, dtype=torch.float32,
                          device=torch.device("cpu"), max_num_tokens=64, max_num_seqs=1, max_blocks_per_seq=16)
    caches = backend.allocate_kv_caches(args.num_layers)
    ctx = 100
    meta = backend.build_metadata(StepBatch(seqs=[SeqChunk(0, 1, ctx, list(range(8)))], slot_mapping=[ctx]))
    ids, pos = torch.tensor([300]), torch.tensor([ctx])
    native = NativeStep.for_model(model)

    def step(use_native):
        model.native_step = native if use_native else None
        with torch.inference_mode():
            return model(ids, pos, caches, meta)

    isas = quant.ISAS[:quant.ISAS.index(quant.cpu_isa()) + 1]
    rows: dict[str, list[float]] = {}
    big = torch.randn(256 * 1024 * 1024)
    def mode(act, layout):  # the layers' activations, and the layout that repacks them in place
        os.environ["ASYNCENGINE_QUANT_LAYOUT"] = layout
        set_quantized_activations(model, act)
        step(True)  # first use of this table

    for _ in range(a.rounds):
        for act, layout in (("int8", "x8"), ("int8", "rows"), ("fp32", "rows")):
            mode(act, layout)
            tag = f"{act} {layout}" if act == "int8" else act
            for isa in (isas if act == "int8" else ["auto"]):
                quant.set_isa(isa)
                name = f"projections {tag}" + (f" {isa}" if act == "int8" else "")
                rows.setdefault(name, []).append(cpu_ms(lambda: projections(act)))
            quant.set_isa("auto")
            rows.setdefault(f"head {tag}", []).append(cpu_ms(
                lambda: quant.gemm(hx, head.qweight, head.qtype, head.in_features, activations=act,
                                   packed=head.packed), 3))
            for use in (True, False):
                rows.setdefault(f"step layers {'native' if use else 'per-op'} {tag}", []).append(
                    cpu_ms(lambda: step(use), 5))
        os.environ.pop("ASYNCENGINE_QUANT_LAYOUT")
        t = time.thread_time()
        big.sum()
        rows.setdefault("read_gb_s", []).append(big.numel() * 4 / (time.thread_time() - t) / 1e9)
    result = {"command": "python benchmarks/decode_kernels.py " + " ".join(sys.argv[1:]),
              "load_avg": os.getloadavg(),
              "model": gguf_path(a.model), "cpu": cpu_info(), "int8_isa_auto": quant.cpu_isa(), "threads": 1,
              "projection_bytes_per_token": proj_bytes, "head_bytes": head.qweight.numel(),
              "ms_cpu": {k: spread(v) for k, v in rows.items() if k != "read_gb_s"},
              "read_gb_s": spread(rows["read_gb_s"])}
    result["projections_gb_s"] = {k: proj_bytes / v["median"] / 1e6 for k, v in result["ms_cpu"].items()
                                  if k.startswith("projections")}
    result["head_gb_s"] = {k: head.qweight.numel() / v["median"] / 1e6 for k, v in result["ms_cpu"].items()
                           if k.startswith("head")}
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
