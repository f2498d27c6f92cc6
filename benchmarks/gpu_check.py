#!/usr/bin/env python
"""One command for a CUDA machine: does asyncengine work on this GPU, and how fast?

    python benchmarks/gpu_check.py            # on the GPU machine, from the repository root
    python benchmarks/gpu_check.py --dry-run  # anywhere: the same sections, tiny, on CPU

Runs against the installed package (`pip install -e .`; on a machine without internet, install
from carried wheels) with whatever torch / triton it finds; transformers and safetensors must import
for the engine sections. Downloads nothing: every model is made here with random weights (the bench model's
shape, and SmolLM2-135M's). Sections, each guarded (a failure is a table row, never a crash):

  tests         the GPU test subset (kernels, triton backend, CUDA runner), pytest in a subprocess
  copy_bw       device-to-device copy bandwidth: the roofline for memory-bound kernels
  decode_attn   paged attention, decode batch: bytes of K/V read / time, as % of copy_bw (goal >= 70%)
  prefill_attn  paged attention, prefill chunks: TFLOP/s
  cache_write   reshape_and_cache: bytes moved / time, % of copy_bw
  rms_norm      fused RMSNorm(+residual): bytes moved / time, % of copy_bw
  offline       the offline workload (benchmarks/workloads.py) on the bench model, bf16: tok/s
  smollm2       single-stream decode on a SmolLM2-135M-shaped model, CUDA graphs vs eager: tok/s

Prints one table (and --json writes the rows); bounded to about 8 minutes on one GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))
try:  # the installed package (a machine without internet: carry wheels, `pip install --no-index --find-links`)
    import asyncengine.kernels  # noqa: F401
    import msgspec
except ImportError as e:
    sys.exit(f"gpu_check.py runs against the installed package: `pip install -e .` from the repository "
             f"(no internet there: `pip wheel -w wheels .` on a machine with it, carry wheels/, then "
             f"`pip install --no-index --find-links wheels asyncengine`): {e}")
MSGSPEC = f"msgspec {msgspec.__version__}"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

BENCH = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False, rope_theta=10000.0)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False, rope_theta=10000.0)

ROWS: list[dict] = []


def row(section: str, metric: str, value, unit: str = "", note: str = "", ok: bool = True) -> None:
    ROWS.append(dict(section=section, metric=metric, value=value, unit=unit, note=note, ok=ok))


def section(name: str, fn, *args) -> None:
    t0 = time.perf_counter()
    try:
        fn(*args)
    except Exception as e:  # one failing section must not hide the others
        row(name, "FAILED", f"{type(e).__name__}: {e}"[:160], ok=False)
        traceback.print_exc()
    print(f"[gpu_check] {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def make_model(out_dir: Path, shape: dict, device: torch.device, max_pos: int = 4096, seed: int = 0) -> str:
    """A Llama checkpoint with random weights, generated on the device, saved as bf16 safetensors."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    h, i, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hq, hk, v = shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]
    d = h // hq
    g = torch.Generator(device=device).manual_seed(seed)

    def w(*s, std=None):
        std = std if std is not None else s[-1] ** -0.5
        return (torch.randn(*s, generator=g, device=device) * std).to(torch.bfloat16).cpu()

    t = {"model.embed_tokens.weight": w(v, h, std=1.0), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not shape["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, h)
    for n in range(L):
        p = f"model.layers.{n}."
        t[p + "self_attn.q_proj.weight"] = w(hq * d, h)
        t[p + "self_attn.k_proj.weight"] = w(hk * d, h)
        t[p + "self_attn.v_proj.weight"] = w(hk * d, h)
        t[p + "self_attn.o_proj.weight"] = w(h, hq * d)
        t[p + "mlp.gate_proj.weight"] = w(i, h)
        t[p + "mlp.up_proj.weight"] = w(i, h)
        t[p + "mlp.down_proj.weight"] = w(h, i)
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(t, str(out_dir / "model.safetensors"))
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
               max_position_embeddings=max_pos, bos_token_id=0, eos_token_id=1, pad_token_id=2,
               torch_dtype="bfloat16", **shape)
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return str(out_dir)


def cuda_time(fn, iters: int, device: torch.device) -> float:
    """Median-free mean seconds per call, CUDA events around `iters` calls after a warm-up (CPU: wall clock)."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


# ------------------------------------------------------------------------------------------ sections

def s_tests(args) -> None:
    files = ["tests/kernels", "tests/attention/test_triton_backend.py", "tests/worker/test_cuda_runner_logic.py", "tests/worker/test_gpu.py"]
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs", *files],
                           cwd=REPO, capture_output=True, text=True, timeout=args.tests_timeout)
        tail = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
        row("tests", "pytest GPU subset", tail, note="rc=%d" % r.returncode, ok=r.returncode == 0)
        if r.returncode:
            print(r.stdout[-6000:], r.stderr[-3000:], sep="\n", file=sys.stderr)
    except subprocess.TimeoutExpired:
        row("tests", "pytest GPU subset", f"timed out after {args.tests_timeout} s", ok=False)


def s_copy_bw(dev, args) -> float:
    n = (1 << 30 if dev.type == "cuda" else 1 << 24) // 4
    src = torch.empty(n, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), 20 if dev.type == "cuda" else 3, dev)
    bw = 2 * n * 4 / t  # read + write
    args.copy_bw = bw
    row("copy_bw", "device copy bandwidth", round(bw / 1e9, 1), "GB/s", "read+write of a 1 GiB buffer")
    return bw


def _paged_inputs(dev, B, ctx, q_len, hq, hkv, d, bs, dtype):
    nb_per = -(-ctx // bs)
    num_blocks = B * nb_per + 1
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks - 1, device=dev)[:B * nb_per]
    block_table = perm.view(B, nb_per).to(torch.int32)
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * q_len
    q = torch.randn(B * q_len, hq, d, device=dev, dtype=dtype)
    return q, k_cache, v_cache, block_table, seq_lens, qsl


def s_decode_attn(dev, args) -> None:
    from asyncengine.kernels import paged_attention

    big = dev.type == "cuda"
    dtype = torch.bfloat16 if big else torch.float32
    configs = [(64, 2048, 32, 8, 128), (8, 8192, 32, 8, 128), (256, 1024, 9, 3, 64)] if big else [(2, 40, 4, 2, 16)]
    for B, ctx, hq, hkv, d in configs:
        q, kc, vc, bt, sl, qsl = _paged_inputs(dev, B, ctx, 1, hq, hkv, d, 16, dtype)
        t = cuda_time(lambda: paged_attention(q, kc, vc, bt, sl, qsl, d ** -0.5, max_query_len=1),
                      50 if big else 1, dev)
        moved = 2 * B * ctx * hkv * d * kc.element_size() + 2 * q.numel() * q.element_size()
        pct = 100 * moved / t / args.copy_bw
        row("decode_attn", f"B={B} ctx={ctx} Hq/Hkv={hq}/{hkv} D={d}", round(pct, 1), "% roofline",
            f"{moved / t / 1e9:.0f} GB/s, {t * 1e6:.0f} us", ok=pct >= 70 or not big)


def s_prefill_attn(dev, args) -> None:
    from asyncengine.kernels import paged_attention

    big = dev.type == "cuda"
    dtype = torch.bfloat16 if big else torch.float32
    B, ctx, hq, hkv, d = (4, 2048, 32, 8, 128) if big else (1, 24, 4, 2, 16)
    q, kc, vc, bt, sl, qsl = _paged_inputs(dev, B, ctx, ctx, hq, hkv, d, 16, dtype)
    t = cuda_time(lambda: paged_attention(q, kc, vc, bt, sl, qsl, d ** -0.5), 10 if big else 1, dev)
    flops = 4 * B * hq * d * ctx * ctx / 2  # causal: half of QK^T and PV
    row("prefill_attn", f"B={B} len={ctx} Hq/Hkv={hq}/{hkv} D={d}", round(flops / t / 1e12, 1), "TFLOP/s",
        f"{t * 1e3:.2f} ms")


def s_cache_write(dev, args) -> None:
    from asyncengine.kernels import reshape_and_cache

    big = dev.type == "cuda"
    T, hkv, d, bs = (8192, 8, 128, 16) if big else (16, 2, 16, 16)
    dtype = torch.bfloat16 if big else torch.float32
    nb = T // bs * 2
    k, v = (torch.randn(T, hkv, d, device=dev, dtype=dtype) for _ in range(2))
    kc, vc = (torch.zeros(nb, bs, hkv, d, device=dev, dtype=dtype) for _ in range(2))
    slots = torch.randperm(nb * bs, device=dev)[:T]
    t = cuda_time(lambda: reshape_and_cache(k, v, kc, vc, slots), 50 if big else 1, dev)
    moved = 4 * k.numel() * k.element_size() + slots.numel() * 8
    row("cache_write", f"T={T} Hkv={hkv} D={d}", round(100 * moved / t / args.copy_bw, 1), "% roofline",
        f"{moved / t / 1e9:.0f} GB/s")


def s_rms_norm(dev, args) -> None:
    from asyncengine.kernels import rms_norm

    big = dev.type == "cuda"
    T, h = (8192, 4096) if big else (8, 64)
    dtype = torch.bfloat16 if big else torch.float32
    x, r = (torch.randn(T, h, device=dev, dtype=dtype) for _ in range(2))
    w = torch.ones(h, device=dev, dtype=dtype)
    t = cuda_time(lambda: rms_norm(x, w, 1e-6, residual=r), 50 if big else 1, dev)
    moved = 4 * x.numel() * x.element_size()  # read x, r; write normed, sum
    row("rms_norm", f"T={T} H={h} +residual", round(100 * moved / t / args.copy_bw, 1), "% roofline",
        f"{moved / t / 1e9:.0f} GB/s")


def s_offline(dev, args) -> None:
    from asyncengine import LLM, SamplingParams
    from workloads import make_workload

    big = dev.type == "cuda"
    shape = BENCH if big else TINY
    model = make_model(args.tmp / "bench", shape, dev)
    reqs = make_workload("offline" if big else "small", shape["vocab_size"])
    if not big:
        reqs = reqs[:4]
    llm = LLM(model, dtype="bfloat16" if big else "float32", device=str(dev), skip_tokenizer_init=True,
              max_model_len=1024 if big else 128)
    sps = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in reqs]
    llm.generate([reqs[0][0]], sps[0], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], sps, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p, _ in reqs)
    cfg = llm.config
    row("offline", f"{len(reqs)} requests, bench model {cfg.torch_dtype}".replace("torch.", ""),
        round(n_out / dt), "out tok/s", f"{(n_in + n_out) / dt:.0f} total tok/s, {dt:.1f} s, "
        f"attention={cfg.attention_backend_name}, kv blocks={llm.engine.num_blocks}")
    if hasattr(llm, "shutdown"):
        llm.shutdown()


def s_smollm2(dev, args) -> None:
    from asyncengine import LLM, SamplingParams

    big = dev.type == "cuda"
    model = make_model(args.tmp / "smollm2", SMOLLM2 if big else TINY, dev, max_pos=8192 if big else 256)
    prompt = list(range(3, 35))
    n = 512 if big else 8
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = LLM(model, dtype="bfloat16" if big else "float32", device=str(dev), skip_tokenizer_init=True,
                  enforce_eager=eager, max_model_len=2048 if big else 128, max_num_seqs=8)
        llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        t0 = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        tokens[eager] = out.outputs[0].token_ids
        row("smollm2", "decode, " + ("eager" if eager else "CUDA graphs"), round(n / dt, 1), "tok/s",
            f"1 stream, {n} tokens, {1e3 * dt / n:.2f} ms/token")
        if hasattr(llm, "shutdown"):
            llm.shutdown()
        del llm
    same = tokens[True] == tokens[False]
    row("smollm2", "graphs == eager tokens", same, ok=same)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="no CUDA needed: tiny sizes on CPU (checks the script)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--tests-timeout", type=int, default=240)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.dry_run:
        dev = torch.device("cpu")
        os.environ["TRITON_INTERPRET"] = "1"  # kernels run in triton's CPU interpreter
    elif not torch.cuda.is_available():
        print("gpu_check: needs CUDA (torch sees no GPU here); use --dry-run to check the script on CPU",
              file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda")
    skip = {s for s in args.skip.split(",") if s} | ({"tests"} if args.dry_run else set())
    args.copy_bw = float("nan")
    env = f"torch {torch.__version__}, python {sys.version.split()[0]}, {MSGSPEC}"
    try:
        import triton
        env += f", triton {triton.__version__}"
    except Exception as e:
        env += f", triton missing ({type(e).__name__})"
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        env = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}; " + env
    row("env", "machine", env)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        args.tmp = Path(tmp)
        plan = [("tests", s_tests, args), ("copy_bw", s_copy_bw, dev, args), ("decode_attn", s_decode_attn, dev, args),
                ("prefill_attn", s_prefill_attn, dev, args), ("cache_write", s_cache_write, dev, args),
                ("rms_norm", s_rms_norm, dev, args), ("offline", s_offline, dev, args),
                ("smollm2", s_smollm2, dev, args)]
        for name, fn, *fargs in plan:
            if name in skip:
                row(name, "skipped", "--dry-run" if args.dry_run and name == "tests" else "--skip", ok=True)
                continue
            section(name, fn, *fargs)
    total = time.perf_counter() - t_start
    row("total", "wall time", round(total, 1), "s", "budget 480 s", ok=total <= 480 or args.dry_run)
    print_table(ROWS)
    if args.json:
        Path(args.json).write_text(json.dumps(ROWS, indent=1, default=str))
    return 0 if all(r["ok"] for r in ROWS) else 1


def print_table(rows) -> None:
    cols = ["section", "metric", "value", "unit", "note"]
    cells = [[("" if r["ok"] else "!! ") + str(r["section"])] + [str(r[c]) for c in cols[1:]] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    line = " | ".join(c.ljust(w) for c, w in zip(cols, widths))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for x in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(x, widths)))


if __name__ == "__main__":
    sys.exit(main())
