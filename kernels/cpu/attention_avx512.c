/* attention.c's per-item loop (attn_rows) with AVX-512, for block sizes that are a multiple of 16
 * and head dims that are a multiple of 32: the rows of a tile share each block's keys, scores come
 * 16 keys at a time (one accumulator per key, then one transposing reduction), and the value pass
 * keeps groups of rows' accumulators in registers while each value row is converted once.
 * QK uses vdpbf16ps on bf16 caches where the CPU has AVX512-BF16 (q and k multiplied as stored,
 * the product exact in fp32, sums in fp32: the scale is applied to the scores). The scalar/AVX2
 * loop spent ~250 cycles per key and head reading a bf16 cache (3 GB/s of K/V, one thread, a
 * 128-sequence decode); this one is bound by reading the cache (figures: docs/cpu_decode.md).
 *
 * A row's result depends on its own keys only (keys outside its range get weight 0 exactly, and
 * fma(0, v, a) == a), so it is the same whatever rows share its tile: batch invariant.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention_rows.h"
#include "simd.h"

#if AE_X86

#define TGT AE_TGT_AVX512
#define TGT_BF16 AE_TGT_AVX512_BF16

/* 16 vectors of per-key partial sums -> one vector of the 16 keys' sums, in key order. */
static inline TGT __m512 reduce16(__m512 a[16]) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}

/* Scores of the 16 keys at kb (rows of D) for one row: fp32 q (scaled) against fp32 or bf16 keys. */
static inline TGT __attribute__((always_inline)) __m512 qk16_f32(const float *q, const void *kb, int D, int bf16) {
    __m512 a[16];
    for (int k = 0; k < 16; k++) a[k] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        __m512 qv = _mm512_loadu_ps(q + d);
        for (int k = 0; k < 16; k++) {
            long o = (long)k * D + d;
            __m512 kv = bf16 ? ae_ld_bf16x16((const uint16_t *)kb + o) : _mm512_loadu_ps((const float *)kb + o);
            a[k] = _mm512_fmadd_ps(qv, kv, a[k]);
        }
    }
    return reduce16(a);
}

/* The same with vdpbf16ps: q as stored (bf16, unscaled), times scale at the end. */
static inline TGT_BF16 __attribute__((always_inline)) __m512 qk16_dp(const uint16_t *q, const uint16_t *kb, int D,
                                                                      float scale) {
    __m512 a[16];
    for (int k = 0; k < 16; k++) a[k] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32) {
        __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
        for (int k = 0; k < 16; k++)
            a[k] = _mm512_dpbf16_ps(a[k], qv, (__m512bh)_mm512_loadu_si512(kb + (long)k * D + d));
    }
    return _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale));
}

/* acc[r] = acc[r] * corr[r] + sum_j p[r][j] v_j over keys [j0, j1) of a chunk, for NR rows; key j's
 * value row is row (j & 15) of its 16-key group vg[j >> 4] (the groups may lie in different blocks).
 * A slice of 64 (or 32) dims of every row stays in registers over the keys: NR x 4 independent FMA
 * chains. One 16-dim slice at a time left 1-2 chains (a decode row and its GQA partner), bound by
 * the FMA's latency: ~16 cycles per key and KV head (figures: docs/cpu_decode.md). */
static inline TGT __attribute__((always_inline)) void pv_rows(float *acc, const float *corr, const float *p,
                                                               const char *const *vg, int j0, int j1, int D,
                                                               int bf16, int NR) {
    const int NV = D % 64 ? 2 : 4; /* vectors per slice */
    for (int d = 0; d < D; d += 16 * NV) {
        __m512 a[4][4];
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < NV; t++)
                a[r][t] = _mm512_mul_ps(_mm512_loadu_ps(acc + (long)r * D + d + 16 * t), _mm512_set1_ps(corr[r]));
        for (int j = j0; j < j1; j++) {
            const long o = (long)(j & 15) * D + d;
            __m512 v[4];
            for (int t = 0; t < NV; t++)
                v[t] = bf16 ? ae_ld_bf16x16((const uint16_t *)vg[j >> 4] + o + 16 * t)
                            : _mm512_loadu_ps((const float *)vg[j >> 4] + o + 16 * t);
            for (int r = 0; r < NR; r++) {
                const __m512 pj = _mm512_set1_ps(p[r * AE_ATTN_MAX_BS + j]);
                for (int t = 0; t < NV; t++) a[r][t] = _mm512_fmadd_ps(pj, v[t], a[r][t]);
            }
        }
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < NV; t++) _mm512_storeu_ps(acc + (long)r * D + d + 16 * t, a[r][t]);
    }
}

/* The K and V slabs of block pb of an item, into L2. Measured (one thread, 128 decoding sequences
 * x 400 keys, bf16, blocks of 16 shuffled: the cache streams from DRAM): a burst of the item's first
 * 64 blocks at its start, then one block 64 ahead, 36 -> 29 ns per (key, kv head); prefetching
 * 1-16 blocks ahead instead changed nothing (36-37 ns). */
#ifndef AE_ATTN_PREFETCH
#define AE_ATTN_PREFETCH 64
#endif
/* keys per online-softmax step (attention_avx512_rows.h) */
#ifndef AE_ATTN_CHUNK
#define AE_ATTN_CHUNK 64
#endif
static inline TGT void prefetch_block(const struct attn_rows_args *A, int pb, int bs, int D, int elem) {
    const long off = (A->head_off + (long)A->table[pb] * bs * D) * elem, bytes = (long)bs * D * elem;
    for (long o = 0; o < bytes; o += 64) {
        _mm_prefetch((const char *)A->kc + off + o, _MM_HINT_T1);
        _mm_prefetch((const char *)A->vc + off + o, _MM_HINT_T1);
    }
}

#define RA_FN rows_impl_f32
#define RA_TGT TGT
#define RA_DP 0
#include "attention_avx512_rows.h"
#undef RA_FN
#undef RA_TGT
#undef RA_DP
#define RA_FN rows_impl_dp
#define RA_TGT TGT_BF16
#define RA_DP 1
#include "attention_avx512_rows.h"
#undef RA_FN
#undef RA_TGT
#undef RA_DP

/* constant head dim and cache type, so the compiler unrolls the loops over D */
static TGT void rows_f32_any(const struct attn_rows_args *A, int bf16) {
    if (bf16) rows_impl_f32(A, A->D, 1); else rows_impl_f32(A, A->D, 0);
}
static TGT void rows_f32_64(const struct attn_rows_args *A, int bf16) {
    if (bf16) rows_impl_f32(A, 64, 1); else rows_impl_f32(A, 64, 0);
}
static TGT_BF16 void rows_dp_any(const struct attn_rows_args *A) { rows_impl_dp(A, A->D, 1); }
static TGT_BF16 void rows_dp_64(const struct attn_rows_args *A) { rows_impl_dp(A, 64, 1); }

int attn_rows_avx512(const struct attn_rows_args *A, int bf16, int isa) {
    if (isa < AE_ISA_AVX512 || A->bs % 16 || A->D % 32) return 0;
    if (bf16 && isa >= AE_ISA_AVX512_BF16) {
        if (A->D == 64) rows_dp_64(A); else rows_dp_any(A);
    } else {
        if (A->D == 64) rows_f32_64(A, bf16); else rows_f32_any(A, bf16);
    }
    return 1;
}

#else
int attn_rows_avx512(const struct attn_rows_args *A, int bf16, int isa) {
    (void)A, (void)bf16, (void)isa;
    return 0;
}
#endif
