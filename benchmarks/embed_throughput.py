#!/usr/bin/env python
"""Embeddings per second: our BERT encoder (packed batch; with --engine also ``LLM.embed``, each text a
request through the scheduler) against sentence-transformers, on one
random-weight MiniLM-shaped checkpoint (384 hidden, 6 layers, 12 heads, mean pooling + Normalize),
batches of 32 texts of uneven length, tokenisation included on both sides. The two alternate
round by round (order flipped every round) so a noisy machine's slow minutes fall on both alike.

    python benchmarks/embed_throughput.py --rounds 7 --batches 4 --threads 2

Prints per side the median embeddings/s and the spread (min..max over rounds), the ratio of the
medians, and the largest cosine gap between the two sides' embeddings (a correctness check)."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from single_stream import cpu_info  # the CPU model and SIMD flags, as every benchmark records them

import torch
import transformers

WORDS = [f"w{i}" for i in range(600)]


def make_checkpoint(root: Path, hidden: int, layers: int) -> None:
    torch.manual_seed(0)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(str(root / "vocab.txt")).save_pretrained(root)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=hidden // 32, intermediate_size=4 * hidden,
                                  max_position_embeddings=512, architectures=["BertModel"])
    transformers.BertModel(cfg).save_pretrained(root)
    mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (root / "modules.json").write_text(json.dumps(mods))
    (root / "1_Pooling").mkdir()
    (root / "2_Normalize").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True}))


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120))) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", type=int, default=4, help="batches of --batch texts per round and side")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--engine", action="store_true", help="also LLM.embed: through the engine's scheduler")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from asyncengine.models.bert import embed_token_ids, load_bert
    from asyncengine.models.st_pooling import read_st_pooling

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        make_checkpoint(root, args.hidden, args.layers)
        st = SentenceTransformer(str(root), device="cpu")
        ours, spec = load_bert(root), read_st_pooling(root)
        tok = transformers.AutoTokenizer.from_pretrained(root)
        batches = [texts(args.batch, i) for i in range(args.batches)]

        def run_ours():
            return [embed_token_ids(ours, tok(b)["input_ids"], [spec] * len(b)) for b in batches]

        def run_st():
            return [st.encode(b, batch_size=args.batch, convert_to_tensor=True) for b in batches]

        a, b = run_ours(), run_st()  # warm-up, and the correctness check
        gap = max(1 - float(torch.dot(x, y)) for xs, ys in zip(a, b) for x, y in zip(xs, ys))
        rates = {"asyncengine": [], "sentence-transformers": []}
        sides = [("asyncengine", run_ours), ("sentence-transformers", run_st)]
        if args.engine:
            from asyncengine import LLM

            llm = LLM(str(root), dtype="float32", device="cpu", num_threads=args.threads, max_num_seqs=args.batch,
                      max_num_batched_tokens=args.batch * 160)

            def run_engine():
                return [llm.embed(b) for b in batches]

            c = run_engine()
            gap = max(gap, max(1 - float(torch.dot(torch.tensor(x), y)) for xs, ys in zip(c, b) for x, y in zip(xs, ys)))
            rates["asyncengine LLM.embed"] = []
            sides.append(("asyncengine LLM.embed", run_engine))
        for r in range(args.rounds):
            for name, fn in (sides if r % 2 == 0 else sides[::-1]):
                t = time.perf_counter()
                fn()
                rates[name].append(args.batch * args.batches / (time.perf_counter() - t))
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"BERT {args.hidden}x{args.layers}, batch {args.batch}, {args.threads} threads, {args.rounds} rounds")
    print(f"  cpu {json.dumps(cpu_info())}")
    for k, v in rates.items():
        print(f"  {k:22s} median {med[k]:8.1f} emb/s  spread {min(v):.1f}..{max(v):.1f}")
    print(f"  ratio (ours/st medians) {med['asyncengine'] / med['sentence-transformers']:.2f}x;"
          f" largest 1-cos gap {gap:.2e}")
    if args.engine:
        print(f"  ratio (LLM.embed/st medians) {med['asyncengine LLM.embed'] / med['sentence-transformers']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
