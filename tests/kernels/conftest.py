"""Kernel tests: the Triton kernels (kernels/*.py) and the CPU C kernels (kernels/cpu, test_cpu_kernels.py,
test_quant_kernels.py) against their torch references.

Without CUDA (CI, dev boxes) the kernels run in triton's CPU interpreter on CPU tensors: every test here
gets ``TRITON_INTERPRET=1`` through an autouse fixture, scoped to these tests only, so other test modules
in the same session never see it (``asyncengine.kernels`` hands kernels to ``triton.jit`` at launch time,
and its kernels avoid triton's standard-library @jit helpers, so it does not matter whether or how
triton was imported earlier in the session). On a CUDA machine the kernels are compiled and run on the
GPU, unless TRITON_INTERPRET=1 is already set.

The interpreter never runs triton's compiler, so ``compile_for_cuda`` additionally compiles the real launch
configurations for sm_90 / sm_80 down to a cubin (the triton wheel ships ptxas): no GPU needed.

triton itself is a hard requirement of these tests (it is in the dev extra): a missing triton is an
error, not a skip.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")

TRITON_HINT = (
    "the kernel tests need triton (CPU interpreter mode, TRITON_INTERPRET=1, needs no GPU): "
    "`pip install triton` or `pip install -e '.[dev]'`"
)


@pytest.fixture(autouse=True)
def _triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail (never skip) without triton; run kernels in the CPU interpreter when there is no CUDA."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError as e:  # pragma: no cover - only on a dev env without the dev extra
        pytest.fail(f"{TRITON_HINT} ({e})", pytrace=False)
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T (+ pad), Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    keys: list[torch.Tensor]  # per request, dense [seq_len, Hkv, D] (what the cache holds)
    values: list[torch.Tensor]
    q_lens: list[int]
    scale: float

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_table, self.seq_lens, self.query_start_loc, self.scale)


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device = DEVICE,
    seed: int = 0,
    spare_blocks: int = 3,
    pad_tokens: int = 0,
    strided_q: bool = False,
    nan_fill: bool = True,
) -> PagedBatch:
    """A batch whose K/V already sit in a paged cache at shuffled (non-contiguous) physical blocks.

    Cache slots that belong to no request hold NaN (``nan_fill``) and unused block-table entries hold an
    out-of-range block id, so a kernel that reads anything outside a request's context fails loudly.
    """
    from asyncengine.kernels import reshape_and_cache_ref

    assert len(q_lens) == len(seq_lens) and all(0 <= q <= s for q, s in zip(q_lens, seq_lens))
    g = torch.Generator().manual_seed(seed)
    num_seqs = len(q_lens)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_needed, default=0) + 1  # one extra (unused) column
    num_blocks = sum(blocks_needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.full((num_seqs, max_blocks), 10**6, dtype=torch.int32)  # garbage: must never be read
    nxt = 0
    for b, n in enumerate(blocks_needed):
        block_table[b, :n] = perm[nxt:nxt + n].to(torch.int32)
        nxt += n

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    fill = float("nan") if nan_fill else 0.0
    k_cache = torch.full(shape, fill, dtype=dtype)
    v_cache = torch.full(shape, fill, dtype=dtype)
    keys, values = [], []
    for b, s in enumerate(seq_lens):
        k = torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype)
        pos = torch.arange(s)
        slots = block_table[b, pos // block_size].long() * block_size + pos % block_size
        reshape_and_cache_ref(k, v, k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)

    total = sum(q_lens)
    rows = total + pad_tokens
    if strided_q:  # q as a slice of a wider fused projection: row stride != Hq * D
        base = torch.randn(rows, num_q_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
        q = base.to(device)[:, :num_q_heads]  # sliced on the device: a copy there would be contiguous
    else:
        q = torch.randn(rows, num_q_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    return PagedBatch(
        q=q.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        block_table=block_table.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device), keys=[k.to(device) for k in keys], values=[v.to(device) for v in values],
        q_lens=list(q_lens), scale=head_dim ** -0.5,
    )


@pytest.fixture
def paged_batch():
    """Factory fixture: ``paged_batch(q_lens, seq_lens, num_q_heads=..., ...)`` -> PagedBatch."""
    return make_paged_batch


# ------------------------------------------------------------------------------------------
# Compile-only check for the real GPU path (no GPU needed)
# ------------------------------------------------------------------------------------------

_TORCH_TO_TRITON = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
}


class _CompileOnly:
    """Stands in for a jitted kernel: `kernel[grid](*args, **kw)` compiles it for a CUDA arch, runs nothing.

    The interpreter is lenient where the compiler is not (loop-carried types, dot shape minimums,
    constexpr handling...), so CI compiles every launch configuration a test makes all the way to a
    cubin with the ptxas that ships in the triton wheel.
    """

    def __init__(self, fn, arch: int, log: list):
        self.fn, self.arch, self.log = fn, arch, log

    def __getitem__(self, grid):
        return self._compile

    OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")

    def _compile(self, *args, **kwargs):
        import inspect

        import triton
        import triton.language
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction

        options = {k: kwargs.pop(k) for k in self.OPTIONS if k in kwargs}
        constexprs = kwargs
        names = list(inspect.signature(self.fn).parameters)
        assert len(args) + len(constexprs) == len(names), (names, len(args), list(constexprs))
        values = dict(zip(names, args)) | constexprs
        signature, consts = {}, {}
        for i, name in enumerate(names):
            v = values[name]
            if name in constexprs:
                signature[name] = "constexpr"
                consts[(i,)] = v
            elif isinstance(v, torch.Tensor):
                signature[name] = "*" + _TORCH_TO_TRITON[v.dtype]
            elif isinstance(v, bool):
                signature[name] = "i1"
            elif isinstance(v, int):
                signature[name] = "i32" if -(2 ** 31) <= v < 2 ** 31 else "i64"
            elif isinstance(v, float):
                signature[name] = "fp32"
            else:
                raise TypeError(f"{name}: cannot type {type(v)}")
        self.fn.__globals__["tl"] = triton.language  # what kernels._jit does before decorating
        src = ASTSource(fn=JITFunction(self.fn), signature=signature, constexprs=consts)
        # If triton was first imported with TRITON_INTERPRET=1, its standard library (the reduce
        # combine functions our kernels name) is interpreter-only: compile against jitted copies.
        std = triton.language.standard
        saved = {}
        for name in ("_elementwise_max", "_sum_combine"):
            f = getattr(std, name)
            if not isinstance(f, JITFunction):
                saved[name] = f
                setattr(std, name, JITFunction(f.fn))
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", self.arch, 32), options=options)
        finally:
            for name, f in saved.items():
                setattr(std, name, f)
        assert kernel.asm.get("cubin"), "no cubin produced"
        self.log.append((self.fn.__name__, kernel))


@pytest.fixture
def compile_for_cuda(monkeypatch: pytest.MonkeyPatch):
    """``compile_for_cuda(module, arch=90)``: the module's launchers compile instead of run; returns the log."""
    log: list = []

    def install(module, arch: int = 90) -> list:
        monkeypatch.setattr(module, "_jit", lambda fn: _CompileOnly(fn, arch, log))
        return log

    return install
