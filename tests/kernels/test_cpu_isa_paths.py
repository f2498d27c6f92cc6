"""Every ISA path of the dense CPU kernels (kernels/cpu/isa.c levels: portable C, AVX2, AVX-512,
AVX-512 + BF16's vdpbf16ps, AMX-BF16 tiles for bf16 attention) forced in turn and checked against
torch: paged attention (fp32 and bf16 caches, shapes on and off each path's vector loop), the fused
elementwise ops, and the ``ASYNCENGINE_CPU_ISA`` switch. A level this CPU cannot execute is
skipped, saying why; the C and AVX2 levels run on every x86 machine with AVX2.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from test_cpu_kernels import cached, dense, make_step

from asyncengine.kernels.cpu import attention as A
from asyncengine.kernels.cpu import build, isa, ops


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    if not A.available():
        pytest.fail(f"the CPU kernels did not build here: {build.build_error()}", pytrace=False)


@pytest.fixture(params=isa.ISAS)
def level(request):
    best = isa.cpu_isa()
    if isa.ISAS.index(request.param) > isa.ISAS.index(best):
        pytest.skip(f"this CPU (or its OS) runs at most {best}, not {request.param}")
    assert isa.set_isa(request.param) == request.param
    yield request.param
    isa.set_isa("auto")


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d,bs", [
    (8, 4, 64, 16),  # the bench model: GQA 2, the AVX-512 loop's specialised head dim
    (32, 8, 64, 32),  # several row tiles per kv head, two 16-key chunks per block
    (4, 1, 96, 16),  # MQA, a head dim of the AVX-512 loop that is not 64
    (6, 2, 40, 16),  # head dim % 32 != 0: AVX-512 levels fall back to the AVX2 loop
    (8, 2, 32, 8),  # block size % 16 != 0: the same
])
def test_attention_each_level(level, hq, hk, d, bs, dtype, window):
    q, k_cache, v_cache, seqs = make_step(hq, hk, d, bs, dtype, seed=hq + d + bs)
    owned = {blk for *_, blocks in seqs for blk in blocks}
    free = [blk for blk in range(k_cache.shape[1]) if blk not in owned]
    k_cache[:, free] = float("nan")  # blocks no sequence owns: must never be read
    v_cache[:, free] = float("nan")
    batch = A.PagedBatch.build(seqs, bs)
    scale = d ** -0.5
    out = torch.empty(q.shape, dtype=dtype)
    A.paged_attention(q, k_cache, v_cache, batch, scale, out, window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for q0, n, c, blocks in seqs:
        want = dense(q[q0:q0 + n], cached(k_cache, blocks, c + n, bs), cached(v_cache, blocks, c + n, bs), c,
                     scale, window)
        torch.testing.assert_close(out[q0:q0 + n].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d,bs", [
    (8, 4, 64, 16),  # GQA 2 on the AVX-512 loop
    (4, 1, 96, 16),  # MQA, AVX-512 loop at a head dim that is not 64
    (6, 2, 40, 16),  # head dim % 32 != 0: the C / AVX2 loop at every level
])
def test_attention_softcap_each_level(level, hq, hk, d, bs, dtype, window):
    """Gemma 2's soft-capping (scaled scores -> cap * tanh(s / cap), before the softmax) on every
    level's loop, against dense fp64 and the torch fallback; q is scaled up so the cap bites."""
    q, k_cache, v_cache, seqs = make_step(hq, hk, d, bs, dtype, seed=hq + d + bs + 1)
    q = q * 4  # scores of several units: tanh far from linear at cap 1.5
    batch = A.PagedBatch.build(seqs, bs)
    scale, cap = d ** -0.5, 1.5
    out, plain, ref = (torch.empty(q.shape, dtype=dtype) for _ in range(3))
    A.paged_attention(q, k_cache, v_cache, batch, scale, out, window, softcap=cap)
    A.paged_attention(q, k_cache, v_cache, batch, scale, plain, window)
    A.paged_attention_torch(q, k_cache, v_cache, batch, scale, ref, window, softcap=cap)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for q0, n, c, blocks in seqs:
        want = dense(q[q0:q0 + n], cached(k_cache, blocks, c + n, bs), cached(v_cache, blocks, c + n, bs), c,
                     scale, window, softcap=cap)
        torch.testing.assert_close(out[q0:q0 + n].double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)
    assert (out.float() - plain.float()).abs().max() > 0.1  # the cap changed the result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_do_not_depend_on_their_batch(level, dtype):
    """A sequence's rows get the same bits alone as among others (the batch-invariant mode relies on
    it): rows sharing a tile or a block pass add exactly nothing to each other."""
    q, k_cache, v_cache, seqs = make_step(8, 2, 64, 16, dtype, seed=11)
    together = torch.empty(q.shape, dtype=dtype)
    A.paged_attention(q, k_cache, v_cache, A.PagedBatch.build(seqs, 16), 0.125, together)
    for q0, n, c, blocks in seqs:
        alone = torch.zeros(q.shape, dtype=dtype)
        A.paged_attention(q, k_cache, v_cache, A.PagedBatch.build([(q0, n, c, blocks)], 16), 0.125, alone)
        assert torch.equal(alone[q0:q0 + n], together[q0:q0 + n])


def _repaged(cache, seqs, bs_from, bs_to, seed):
    """The same sequences' keys in a cache of ``bs_to``-token blocks (shuffled), and their tables."""
    hk, d = cache.shape[0], cache.shape[3]
    per = [-(-(c + n) // bs_to) for _, n, c, _ in seqs]
    order = random.Random(seed).sample(range(sum(per)), sum(per))
    out = torch.full((hk, sum(per), bs_to, d), float("nan"), dtype=cache.dtype)
    tables, used = [], 0
    for (q0, n, c, blocks), k in zip(seqs, per):
        table, used = order[used:used + k], used + k
        rows = cached(cache, blocks, c + n, bs_from)  # [c + n, hk, d]
        for p in range(c + n):
            out[:, table[p // bs_to], p % bs_to] = rows[p]
        tables.append((q0, n, c, table))
    return out, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_do_not_depend_on_the_block_size(level, dtype):
    """The AVX-512 loop and the AMX tiles step the online softmax over 64-key chunks of positions:
    the same keys paged in blocks of 16, 32 or 64 give the same bits (below AVX-512 the loops step
    per block, so only the values agree)."""
    q, k16, v16, seqs = make_step(8, 2, 64, 16, dtype, seed=12)
    results = []
    for bs in (16, 32, 64):
        k_cache, tables = _repaged(k16, seqs, 16, bs, seed=bs)
        v_cache, _ = _repaged(v16, seqs, 16, bs, seed=bs)
        out = torch.empty(q.shape, dtype=dtype)
        A.paged_attention(q, k_cache, v_cache, A.PagedBatch.build(tables, bs), 0.125, out)
        results.append(out)
    for other in results[1:]:
        if level.startswith(("avx512", "amx")):
            assert torch.equal(other, results[0])
        else:
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(other, results[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_ops_each_level(level, dtype):
    torch.manual_seed(5)
    exact = dict(atol=0, rtol=0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    for rows, dim in ((1, 512), (5, 72), (3, 37)):  # 72, 37: the scalar tails after 16 / 8 lanes
        x, r, w = (torch.randn(rows, dim) * 3).to(dtype), torch.randn(rows, dim).to(dtype), torch.randn(dim).to(dtype)
        out, s = ops.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(s, x + r)
        torch.testing.assert_close(out, ops.rms_norm_torch(x + r, w, 1e-5), **tol)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ops.rms_norm_torch(x, w, 1e-5), **tol)
        g = (torch.randn(rows, 2 * dim) * 4).to(dtype)
        silu_tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(ops.silu_and_mul(g), ops.silu_and_mul_torch(g), **silu_tol)
    for d in (64, 128, 48, 20):  # half a head a multiple of 16, of 8, neither
        qk = torch.randn(3, 5, d).to(dtype)
        cos, sin = torch.randn(3, 1, d).to(dtype), torch.randn(3, 1, d).to(dtype)
        torch.testing.assert_close(ops.rotary(qk, cos, sin), ops.rotary_torch(qk, cos, sin), **exact)


def test_bf16_stores_round_like_torch(level):
    """The vector bf16 stores round to nearest even, keep NaN a NaN, infinities and denormal
    results (vcvtneps2bf16 would flush those), as torch: rotary's products x * cos, through it."""
    torch.manual_seed(6)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-38, -2e-38, 3e38, 1.0078125, 0.0, -0.0,
                            1.5, 255.0, -1.0])
    x = torch.randn(2, 4, 64)
    x.view(-1)[:special.numel()] = special
    cos = torch.randn(2, 1, 64)
    cos.view(-1)[:8] = torch.tensor([0.5, 2.0, 1.0, 1e-2, 3e-3, 1.5, 1.0078125, 7.0])
    sin = torch.zeros(2, 1, 64)  # x * cos alone: the rounding of one product
    xb, cb, sb = x.to(torch.bfloat16), cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    got, want = ops.rotary(xb, cb, sb), ops.rotary_torch(xb, cb, sb)
    nan = torch.isnan(want)  # NaN's payload bits differ between torch's own conversion paths
    assert nan.any() and torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def _in_subprocess(env_isa: str, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ASYNCENGINE_CPU_ISA=env_isa)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_env_var_forces_the_level():
    best = isa.cpu_isa()
    want = "avx2" if best != "scalar" else "scalar"
    res = _in_subprocess(want, "from asyncengine.kernels.cpu import isa, quant; print(isa.isa(), quant.isa())")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [want, want]
    res = _in_subprocess("sse9", "from asyncengine.kernels.cpu import isa; isa.isa()")
    assert res.returncode != 0 and "ASYNCENGINE_CPU_ISA='sse9'" in res.stderr
    if isa.ISAS.index(best) >= isa.ISAS.index("avx512_bf16"):  # the int8 GEMM's best path under those names
        for top in isa.ISAS[isa.ISAS.index("avx512_bf16"):isa.ISAS.index(best) + 1]:
            res = _in_subprocess(top, "from asyncengine.kernels.cpu import isa, quant; print(isa.isa(), quant.isa())")
            assert res.returncode == 0, res.stderr
            assert res.stdout.split() == [top, "avx512_vnni"]
    else:
        res = _in_subprocess("avx512_bf16", "from asyncengine.kernels.cpu import isa; isa.isa()")
        assert res.returncode != 0 and "cannot execute" in res.stderr


def test_set_isa_refuses_what_the_cpu_cannot_run():
    with pytest.raises(ValueError, match="expected auto or one of"):
        isa.set_isa("sse9")
    best = isa.ISAS.index(isa.cpu_isa())
    if best + 1 < len(isa.ISAS):
        with pytest.raises(ValueError, match="cannot execute"):
            isa.set_isa(isa.ISAS[best + 1])
    assert isa.set_isa("auto") == isa.cpu_isa()


_CAP_HARNESS = r"""
#include <math.h>
#include <stdio.h>
#include "attention_rows.h"
#include "simd.h"
int main(void) {
    long bad8 = 0, bad16 = 0;
    double worst = 0;
    const float caps[] = {50.0f, 30.0f, 5.0f, 1.5f};
    for (int ci = 0; ci < 4; ci++) {
        const float cap = caps[ci];
        for (long i = 0; i < 400000; i += 16) {
            float in[16], o8[16], o16[16];
            for (int k = 0; k < 16; k++) in[k] = ((float)(i + k) - 200000.0f) * 2.5e-5f * cap * (ci + 1);
            _mm256_storeu_ps(o8, ae_softcap8(_mm256_loadu_ps(in), cap));
            _mm256_storeu_ps(o8 + 8, ae_softcap8(_mm256_loadu_ps(in + 8), cap));
            _mm512_storeu_ps(o16, ae_softcap16(_mm512_loadu_ps(in), cap));
            for (int k = 0; k < 16; k++) {
                const float s = attn_softcap1(in[k], cap);
                bad8 += s != o8[k];
                bad16 += s != o16[k];
                const double err = fabs((double)s - cap * tanh((double)in[k] / cap)) / cap;
                worst = err > worst ? err : worst;
            }
        }
    }
    printf("%ld %ld %g\n", bad8, bad16, worst);
    return 0;
}
"""


def test_softcap_same_bits_on_every_loop(tmp_path):
    """The soft-cap of the scalar loop (attention_rows.h) and of the AVX2 / AVX-512 loops (simd.h)
    give the same bits for every score, built with the kernels' own flags, and stay within 1e-6 of
    cap * tanh(s / cap) relative to the cap."""
    if isa.ISAS.index(isa.cpu_isa()) < isa.ISAS.index("avx512_vnni"):
        pytest.skip(f"this CPU runs at most {isa.cpu_isa()}: the harness runs the AVX-512 loop")
    src = tmp_path / "cap.c"
    src.write_text(_CAP_HARNESS)
    flags = [f for f in build._flags() if f not in ("-shared", "-fPIC", "-fopenmp")]
    cc = subprocess.run([build._compiler(), *flags, f"-I{build.SOURCE_DIR}", str(src), "-o", str(tmp_path / "cap"),
                         "-lm"], capture_output=True, text=True, timeout=300)
    assert cc.returncode == 0, cc.stderr
    bad8, bad16, worst = subprocess.run([str(tmp_path / "cap")], capture_output=True, text=True,
                                        timeout=300, check=True).stdout.split()
    assert (int(bad8), int(bad16)) == (0, 0)
    assert float(worst) < 1e-6
