#!/usr/bin/env python
"""A Qwen3-MoE-shaped random GGUF, quantized by llama.cpp: our single-stream decode against
llama-bench's, in interleaved rounds, with each process's peak RSS; and how closely our greedy
tokens follow transformers on the file's dequantized weights (perplexity on random weights means
nothing; agreement with the reference does).

    python benchmarks/gguf_moe.py --dir /tmp/moe-bench [--layers 8 --hidden 1024 --experts 32 --top-k 4
        --moe-inter 512] [--qtypes Q8_0,Q4_K_M] [--rounds 3] [--tokens 64] [--threads 2] [--out result.json]

The model is built once in --dir (HF folder, F16 GGUF by convert_hf_to_gguf.py, then llama-quantize).
llama.cpp is taken from $LLAMA_CPP_DIR (default /work/peers/llama.cpp).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))


def make(args) -> dict[str, Path]:
    from gguf_moe_utils import convert_to_gguf, llama_quantize  # the tests' helpers: llama.cpp's own tools

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    f16 = d / "qwen3_moe-f16.gguf"
    if not f16.exists():
        import torch
        import transformers
        from gguf_utils import tiny_tokenizer

        cfg = transformers.Qwen3MoeConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 256,
            head_dim=64, num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_inter,
            norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.normal_(0.0, p.shape[-1] ** -0.5) if p.dim() >= 2 else p.uniform_(0.5, 1.5)
        convert_to_gguf(model, tiny_tokenizer(), d, "f16")
    files = {"F16": f16}
    for q in args.qtypes.split(","):
        out = d / f"qwen3_moe-{q}.gguf"
        files[q] = out if out.exists() else llama_quantize(f16, out, q)
    return files


def _run(cmd: list[str]) -> tuple[str, int]:
    """(stdout, peak RSS in MiB) of one child process, by ``/usr/bin/time`` (a child forked from
    this process, which may hold the model it built, would report this process's RSS as its peak)."""
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        p = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", rss.name, *cmd], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
        if p.returncode:
            raise RuntimeError(f"{cmd[:3]} failed ({p.returncode})")
        return p.stdout, int(rss.read().split()[-1]) // 1024


def ours(path: Path, args) -> dict:
    out, rss = _run([sys.executable, str(HERE / "single_stream.py"), "--model", str(path), "--dtype", "float32",
                     "--tokens", str(args.tokens), "--prompt-tokens", "32", "--repeat", "2",
                     "--threads", str(args.threads)])
    r = json.loads(out[out.index("{"):])
    return {"decode_tok_s": r["decode_tok_s_best"], "rss_mib": rss, "cpu": r["cpu"]}


def llama_bench(path: Path, args) -> dict:
    binary = Path(os.environ.get("LLAMA_CPP_DIR", "/work/peers/llama.cpp")) / "build" / "bin" / "llama-bench"
    out, rss = _run([str(binary), "-m", str(path), "-t", str(args.threads), "-p", "0", "-n", str(args.tokens),
                     "-r", "2", "-o", "json"])
    r = json.loads(out)[0]
    return {"decode_tok_s": r["avg_ts"], "rss_mib": rss}


def agreement(path: Path, args) -> dict:
    """Greedy tokens of ours (fp32 activations) vs transformers on the file's dequantized weights."""
    import torch
    import transformers

    from asyncengine import LLM, SamplingParams
    from asyncengine.models.gguf import load_gguf
    from gguf_moe_utils import hf_model_with

    ckpt = load_gguf(path, tokenizer=False)
    model = transformers.AutoModelForCausalLM.from_config(ckpt.config, dtype=torch.float32).eval()
    ref = hf_model_with(model, ckpt.tensors)
    prompt = [(7 * i + 11) % 300 + 3 for i in range(32)]
    with torch.inference_mode():
        r = ref.generate(torch.tensor([prompt]), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=None)[0, 32:].tolist()
    llm = LLM(str(path), dtype="float32", quantized_activations="fp32", skip_tokenizer_init=True)
    try:
        got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=args.tokens, temperature=0,
                                                                          ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    g = got[0].outputs[0].token_ids
    same = next((i for i in range(len(r)) if g[i] != r[i]), len(r))
    return {"tokens_equal_before_first_difference": same, "of": len(r)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-inter", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--qtypes", default="Q8_0,Q4_K_M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-agreement", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    files = make(args)
    result = {"args": vars(args), "files_mib": {q: p.stat().st_size >> 20 for q, p in files.items()}, "rounds": []}
    for _ in range(args.rounds):  # interleaved: a slow spell of the shared machine hits both engines
        result["rounds"].append({q: {"ours": ours(files[q], args), "llama_bench": llama_bench(files[q], args)}
                                 for q in args.qtypes.split(",")})
    if not args.no_agreement:
        result["agreement"] = {q: agreement(files[q], args) for q in args.qtypes.split(",")}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
