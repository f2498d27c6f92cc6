#!/usr/bin/env python
"""Rerank pairs per second: a cross-encoder through the engine (``LLM.rerank``: each (query,
document) pair a request through the scheduler, batched whole) against sentence-transformers'
``CrossEncoder.predict``, on one random-weight MiniLM-shaped checkpoint (384 hidden, 6 layers, 12
heads, one label: ms-marco-MiniLM-L-6-v2's shape), one query of 4-12 words against batches of 32
documents of 8-120 words, tokenisation included on both sides. The sides alternate round by
round (order flipped every round) so a noisy machine's slow minutes fall on both alike.

    python benchmarks/rerank_throughput.py --rounds 7 --batches 4 --threads 1

Prints per side the median pairs/s and the spread (min..max over rounds), the ratio of the
medians, and the largest score gap between the sides (a correctness check)."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from embed_throughput import WORDS  # the same vocabulary as the embeddings benchmark
from single_stream import cpu_info  # the CPU model and SIMD flags, as every benchmark records them

import torch
import transformers


def make_cross_encoder(root: Path, hidden: int, layers: int) -> None:
    torch.manual_seed(0)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(str(root / "vocab.txt")).save_pretrained(root)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=hidden // 32, intermediate_size=4 * hidden,
                                  max_position_embeddings=512, num_labels=1,
                                  architectures=["BertForSequenceClassification"])
    transformers.BertForSequenceClassification(cfg).save_pretrained(root)


def workload(n: int, seed: int) -> tuple[str, list[str]]:
    rng = random.Random(seed)
    query = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
    return query, [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120))) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", type=int, default=4, help="batches of --batch documents per round and side")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sentence_transformers import CrossEncoder

    from asyncengine import LLM

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        make_cross_encoder(root, args.hidden, args.layers)
        ce = CrossEncoder(str(root), device="cpu")
        llm = LLM(str(root), dtype="float32", device="cpu", num_threads=args.threads, max_num_seqs=args.batch,
                  max_num_batched_tokens=args.batch * 160)
        batches = [workload(args.batch, i) for i in range(args.batches)]

        def run_ours():
            return [llm.rerank(q, docs) for q, docs in batches]

        def run_st():
            return [ce.predict([(q, x) for x in docs], batch_size=args.batch) for q, docs in batches]

        a, b = run_ours(), run_st()  # warm-up, and the correctness check
        gap = max(abs(x - float(y)) for xs, ys in zip(a, b) for x, y in zip(xs, ys))
        rates = {"asyncengine": [], "sentence-transformers": []}
        sides = [("asyncengine", run_ours), ("sentence-transformers", run_st)]
        for r in range(args.rounds):
            for name, fn in (sides if r % 2 == 0 else sides[::-1]):
                t = time.perf_counter()
                fn()
                rates[name].append(args.batch * args.batches / (time.perf_counter() - t))
        llm.shutdown()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"cross-encoder BERT {args.hidden}x{args.layers}, batch {args.batch}, {args.threads} threads, "
          f"{args.rounds} rounds")
    print(f"  cpu {json.dumps(cpu_info())}")
    for k, v in rates.items():
        print(f"  {k:22s} median {med[k]:8.1f} pairs/s  spread {min(v):.1f}..{max(v):.1f}")
    print(f"  ratio (ours/st medians) {med['asyncengine'] / med['sentence-transformers']:.2f}x;"
          f" largest score gap {gap:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
