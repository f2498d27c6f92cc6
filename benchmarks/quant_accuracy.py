#!/usr/bin/env python
"""Accuracy of quantized weights against the same weights dequantized, on real text.

    python benchmarks/quant_accuracy.py [--model PATH|default] [--quantization auto|int8|int4]
        [--tokens 1024] [--chunk 32] [--out result.json]

Text: this repository's README.md and docs/*.md, tokenized with the model's tokenizer, the first
``--tokens`` tokens. Both models (``--quantization``: "auto" = the checkpoint's own format, i.e. a
GGUF's blocks; vs quantization="none", everything dequantized to fp32) are teacher-forced over the
text in prefill chunks of ``--chunk`` tokens through the engine's own model code and torch
attention backend, and their next-token distributions compared at every position.

Chunks below ``quant.LARGE_M`` (48) rows run the quantized kernel proper (the decode path); larger
chunks take the tiled path (blocks dequantized exactly, then the same torch.mm the dense model
runs), whose logits are bit-identical to the reference: KL 0, which says nothing about the kernel.


  top1_agreement  share of positions where both models' argmax agree (issue 11: >= 0.99)
  mean_kl         mean KL(reference || quantized) in nats (issue 11: <= 0.01)
  max_kl, ppl_reference, ppl_quantized   for context

tests/models/test_smollm2.py asserts the thresholds on the default model.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")  # the text it scores: README + docs


def repo_text() -> str:
    files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return "\n\n".join(open(f, encoding="utf-8").read() for f in files)


def load(path: str, quantization: str | None):
    from asyncengine.config import EngineConfig
    from asyncengine.models.loader import load_model

    cfg = EngineConfig(model=path, dtype="float32", quantization=quantization, max_model_len=None)
    return load_model(cfg, tokenizer=quantization == "none")


def teacher_forced_logits(model, ids: list[int], chunk: int):
    """fp32 logits [n, vocab] of every position, chunk by chunk (one sequence, paged KV cache)."""
    import torch

    from asyncengine.attention.backend import SeqChunk, StepBatch
    from asyncengine.attention.selector import get_backend

    bs = 16
    nb = -(-len(ids) // bs)
    backend = get_backend("torch", num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                          head_dim=model.head_dim, block_size=bs, num_blocks=nb, dtype=torch.float32,
                          device=torch.device("cpu"), max_num_tokens=chunk, max_num_seqs=1)
    kv = backend.allocate_kv_caches(len(model.layers))
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            q = ids[start:start + chunk]
            batch = StepBatch(seqs=[SeqChunk(0, len(q), start, list(range(nb)))],
                              slot_mapping=list(range(start, start + len(q))))
            meta = backend.build_metadata(batch)
            hidden = model(torch.tensor(q), torch.arange(start, start + len(q)), kv, meta)
            yield model.compute_logits(hidden).float()


def measure(path: str, quantization: str | None = None, tokens: int = 1024, chunk: int = 32) -> dict:
    import torch

    ref = load(path, "none")
    ids = ref.tokenizer(repo_text())["input_ids"][:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"only {len(ids)} tokens of text")
    # the reference first, kept as log-probabilities, then the quantized model, both in the same
    # chunks: only the weights' path differs (other chunkings move fp32 attention sums: KL ~1e-5)
    ref_logp = torch.cat([torch.log_softmax(lr, -1) for lr in teacher_forced_logits(ref.model, ids, chunk)])
    del ref
    quant = load(path, quantization).model
    agree, kl_sum, kl_max, nll_ref, nll_q, n = 0, 0.0, 0.0, 0.0, 0.0, 0
    t0 = time.perf_counter()
    for i, lq in enumerate(teacher_forced_logits(quant, ids, chunk)):
        start = i * chunk
        pr = ref_logp[start:start + lq.shape[0]].double()
        pq = torch.log_softmax(lq.double(), -1)
        kl = (pr.exp() * (pr - pq)).sum(-1)
        agree += int((pr.argmax(-1) == pq.argmax(-1)).sum())
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        nxt = torch.tensor(ids[start + 1:start + 1 + lq.shape[0]])
        m = len(nxt)  # the last position has no next token for perplexity
        nll_ref -= float(pr[torch.arange(m), nxt].sum())
        nll_q -= float(pq[torch.arange(m), nxt].sum())
        n += lq.shape[0]
    formats = sorted({m.qtype or "dense" for m in quant.modules() if hasattr(m, "qtype")})
    return {"model": os.path.basename(path), "quantization": quantization or "auto", "formats": formats,
            "tokens": n, "chunk": chunk, "top1_agreement": agree / n, "mean_kl": kl_sum / n, "max_kl": kl_max,
            "ppl_reference": math.exp(nll_ref / (n - 1)), "ppl_quantized": math.exp(nll_q / (n - 1)),
            "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantization", default="auto", choices=["auto", "int8", "int4"])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.model == "default":
        from asyncengine.models.default_model import ensure_default_model

        args.model = ensure_default_model()
    res = measure(args.model, None if args.quantization == "auto" else args.quantization, args.tokens, args.chunk)
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
