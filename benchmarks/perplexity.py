#!/usr/bin/env python
"""Perplexity of a GGUF on a text, ours (each activation mode) beside llama.cpp's, by its method.

    python benchmarks/perplexity.py [--model default|PATH.gguf] [--text FILE] [--ctx 512] [--chunks 8]
        [--activations int8,fp32] [--kv-cache-dtypes auto,int8] [--llama-perplexity PATH]
        [--llama-cache-types f16,q8_0] [--threads 2] [--out result.json]

Method (llama.cpp's ``llama-perplexity -c 512``, examples/perplexity): the whole text is tokenized
once (with BOS where the GGUF's ``tokenizer.ggml.add_bos_token`` asks for it), cut into chunks of
``--ctx`` tokens; each chunk is evaluated on its own (its first token replaced by BOS where BOS is
added) and only its second half is scored: the log-probabilities of tokens ctx/2 + 1 .. ctx - 1
given everything before them in the chunk. PPL = exp(-mean). Ours comes from the engine's own
prompt logprobs (``SamplingParams(prompt_logprobs=0)`` through ``LLM``), so it measures what a user
runs: the default kernels, the paged attention, the fp32 logits.

``--llama-perplexity`` runs the binary (``-t --threads -c --ctx --chunks``) on the same file and
reads its final estimate, once per ``--llama-cache-types`` entry (its ``-ctk``/``-ctv``: ``q8_0`` is
the 8-bit cache ours is compared with, ``--kv-cache-dtypes int8``). Default text: /usr/share/common-licenses/GFDL-1.3 (public, on every
Debian machine, ~5,000 tokens).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import re
import subprocess
import time

DEFAULT_TEXT = "/usr/share/common-licenses/GFDL-1.3"


def gguf_path(model: str) -> str:
    if model in ("default", "smollm2-135m-instruct"):
        from asyncengine.models.default_model import ensure_default_model

        return ensure_default_model()
    return model


def add_bos(path: str) -> tuple[bool, int | None]:
    import gguf

    r = gguf.GGUFReader(path)

    def field(name):
        f = r.fields.get(name)
        return None if f is None else f.parts[f.data[0]].tolist()[0]

    return bool(field("tokenizer.ggml.add_bos_token")), field("tokenizer.ggml.bos_token_id")


def ours(path: str, text: str, ctx: int, chunks: int, activations: str, threads: int,
         kv_cache_dtype: str = "auto") -> dict:
    from asyncengine import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", quantized_activations=activations, num_threads=threads,
              max_model_len=ctx + 8, max_num_seqs=1, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    tok = llm.get_tokenizer() if hasattr(llm, "get_tokenizer") else llm.tokenizer
    bos, bos_id = add_bos(path)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if bos:
        ids = [bos_id] + ids
    n_chunks = min(chunks, len(ids) // ctx)
    if n_chunks < 1:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    nll, count, per_chunk = 0.0, 0, []
    t0 = time.perf_counter()
    for c in range(n_chunks):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if bos:
            chunk[0] = bos_id
        out = llm.generate([{"prompt_token_ids": chunk}], SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                                          temperature=0.0))[0]
        first = ctx // 2
        lps = [out.prompt_logprobs[i][chunk[i]].logprob for i in range(first + 1, ctx)]
        nll -= sum(lps)
        count += len(lps)
        per_chunk.append(math.exp(-sum(lps) / len(lps)))
    llm.shutdown()
    return {"activations": activations, "kv_cache_dtype": kv_cache_dtype, "ppl": math.exp(nll / count), "tokens_scored": count,
            "chunks": n_chunks, "text_tokens": len(ids), "add_bos": bos, "per_chunk_ppl": per_chunk,
            "seconds": time.perf_counter() - t0}


def llama(binary: str, path: str, text_file: str, ctx: int, chunks: int, threads: int, cache_type: str = "f16") -> dict:
    cmd = [binary, "-m", path, "-f", text_file, "-c", str(ctx), "--chunks", str(chunks), "-t", str(threads),
           "-ctk", cache_type, "-ctv", cache_type]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    log = res.stdout + res.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    if res.returncode or not m:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{log[-3000:]}")
    return {"command": " ".join(cmd), "cache_type": cache_type, "ppl": float(m.group(1)), "ppl_stderr": float(m.group(2)),
            "per_chunk_log": re.findall(r"\[\d+\][0-9.]+", log)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--activations", default="int8,fp32")
    ap.add_argument("--kv-cache-dtypes", default="auto")
    ap.add_argument("--llama-perplexity", default=None)
    ap.add_argument("--llama-cache-types", default="f16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    path = gguf_path(a.model)
    text = open(a.text, encoding="utf-8").read()
    result = {"model": path, "text": a.text, "ctx": a.ctx, "machine": platform.processor() or platform.machine(),
              "ours": [ours(path, text, a.ctx, a.chunks, mode, a.threads, kv) for mode in a.activations.split(",")
                       for kv in a.kv_cache_dtypes.split(",")]}
    if a.llama_perplexity:
        peers = [llama(a.llama_perplexity, path, a.text, a.ctx, a.chunks, a.threads, ct)
                 for ct in a.llama_cache_types.split(",")]
        result["llama_cpp"] = peers[0]
        result["llama_cpp_by_cache_type"] = {p["cache_type"]: p for p in peers}
        for r in result["ours"]:  # against the peer's cache of the same width where it ran one
            peer = result["llama_cpp_by_cache_type"].get("q8_0" if r["kv_cache_dtype"] == "int8" else "f16", peers[0])
            r["ratio_to_llama_cpp"] = r["ppl"] / peer["ppl"]
            r["llama_cpp_cache_type"] = peer["cache_type"]
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
