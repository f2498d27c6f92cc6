/* Weight-only quantized matmul on GGUF block formats (Q4_0, Q4_1, Q8_0), fp32 activations.
 *
 * out[M, N] (+)= x[M, K] @ dequant(W)[N, K]^T (+ bias[N])
 *
 * W is kept as GGUF blocks, in the file's row layout or repacked 8 rows at a time (the x8 layout,
 * quant_common.h; the type id carries AE_Q_X8): both are read through ae_qrow, and both give
 * the same bits (same operations per row, only the addresses differ).
 *
 * Why the math is exact: per block we compute d * sum(q * x) + m * sum(x) (Q4_0: m = -8 d), which
 * is the dequantized dot product re-associated, so results equal x @ dequant(W)^T up to fp32
 * summation order (the tests hold it to that). ae_q_gemm quantizes no activation; ae_q_gemm_i8 (quant_i8.c) does, to int8 blocks, for integer dot products, on the instruction set chosen
 * at run time (portable C, AVX2, AVX512-VNNI).
 *
 * Why this loop order: decode (M = 1..16) reads every weight once per step and is bound by the
 * bytes of W; each unpacked block is reused across a tile of up to 4 rows of x held in registers.
 * The N rows are split over OpenMP threads in chunks whose blocks stay in L1/L2 while every M tile
 * passes over them, so larger M re-reads W from cache, not memory.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_common.h"
#include "quant_k.h"

#if defined(__AVX2__) && defined(__FMA__)
#define AE_Q_AVX2 1 /* the fp32 kernel's SIMD path (chosen at build time, -march=native) */
#endif

#define AE_Q_MB 4 /* rows of x per register tile */

/* One block dequantized exactly as the reference does it (q * d + m, or (q - 8) * d). */
static inline void dequant_block(int type, const ae_qrow *r, int64_t b, float *out) {
    float d, m, q[32];
    qrow_block(type, r, b, &d, &m, q);
    if (type == AE_Q_Q4_0) {
        for (int j = 0; j < 32; j++) out[j] = (q[j] - 8.0f) * d;
    } else {
        for (int j = 0; j < 32; j++) out[j] = q[j] * d + m;
    }
}

#if AE_Q_AVX2
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* qp: the block's first 8-byte quant chunk, qstep: chunk to chunk (8 in the row layout, 64 in x8). */
static inline __attribute__((always_inline)) void unpack(int type, const uint8_t *qp, int qstep, __m256 q[4]) {
    if (type == AE_Q_Q8_0) {
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qp + qstep * i))));
        return;
    }
    /* The 16 bytes in both 128-bit lanes; one byte shuffle spreads bytes 0-7 (8-15) into the low
     * byte of each 32-bit lane: the low nibble is that & 15, the high nibble that >> 4. Two shuffles
     * per block instead of six (zero-extends): the shuffle port is what bounds decode here. */
    const __m128i qs = qstep == 8 ? _mm_loadu_si128((const __m128i *)qp)
                                  : _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)qp),
                                                       _mm_loadl_epi64((const __m128i *)(qp + qstep)));
    const __m256i v = _mm256_broadcastsi128_si256(qs);
    const __m256i spread_lo = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                               4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i spread_hi = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                               12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256i a = _mm256_shuffle_epi8(v, spread_lo), c = _mm256_shuffle_epi8(v, spread_hi);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(c, mask));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
}
#endif

/* res[i] = dot(dequant(W row), x row i) for the mb (<= AE_Q_MB) rows of a tile. type and mb are
 * compile-time constants at every call site, so each (type, mb) pair gets its own unrolled code. */
static inline __attribute__((always_inline)) void row_tile(const int type, const int x8, const int mb,
                                                           const uint8_t *base, int i, int64_t nb, const float *x,
                                                           int64_t ldx, const float *xs, float *res) {
    /* base: the row (x8: its group); i: the row in its group. Offsets from constants where x8 is 0 (it
     * is a compile-time constant): through ae_qrow's runtime fields the row layout ran 10-15% slower. */
    const int hdr = type == AE_Q_Q4_1 ? 4 : 2;
    const int64_t step = (x8 ? 8 : 1) * block_bytes(type);
    const int od = x8 ? 2 * i : 0, om = x8 ? 16 + 2 * i : 2, oq = x8 ? 8 * hdr + 8 * i : hdr;
    const int qstep = x8 ? 64 : 8;
    float macc[AE_Q_MB] = {0};
#if AE_Q_AVX2
    __m256 acc[AE_Q_MB];
    for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = base + b * step;
        __m256 q[4];
        unpack(type, blk + oq, qstep, q);
        const float d = fp16_to_fp32(blk + od);
        const __m256 dv = _mm256_set1_ps(d);
        const float m = type == AE_Q_Q4_1 ? fp16_to_fp32(blk + om) : -8.0f * d;
        for (int i = 0; i < mb; i++) {
            const float *xp = x + i * ldx + b * 32;
            __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
            s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xp + 8), s);
            s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xp + 16), s);
            s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp + 24), s);
            acc[i] = _mm256_fmadd_ps(s, dv, acc[i]);
            if (type != AE_Q_Q8_0) macc[i] += m * xs[i * nb + b];
        }
    }
    for (int i = 0; i < mb; i++) res[i] = hsum256(acc[i]) + macc[i];
#else
    float acc[AE_Q_MB] = {0};
    for (int64_t b = 0; b < nb; b++) {
        float d, m, q[32];
        const ae_qrow r = {base, step, od, om, oq, qstep};
        qrow_block(type, &r, b, &d, &m, q);
        for (int i = 0; i < mb; i++) {
            const float *xp = x + i * ldx + b * 32;
            float s = 0.0f;
            for (int j = 0; j < 32; j++) s += q[j] * xp[j];
            acc[i] += d * s;
            if (type != AE_Q_Q8_0) macc[i] += m * xs[i * nb + b];
        }
    }
    for (int i = 0; i < mb; i++) res[i] = acc[i] + macc[i];
#endif
}

/* The K-quants with fp32 activations: each super-block dequantized (k_dequant_block, as the
 * reference) and dotted with every row of x; rows [n0, n1) of out. */
static void chunk_k_f32(int type, int64_t n0, int64_t n1, const float *x, int64_t M, int64_t K, const uint8_t *w,
                        const float *bias, float *out, int64_t ldo, int accumulate) {
    const int bs = block_bytes(type);
    const int64_t nb = K / AE_QK;
    float wf[AE_QK];
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t i = 0; i < M; i++) { /* out[i, n] accumulated block by block below */
            float *o = out + i * ldo + n;
            *o = (accumulate ? *o : 0.0f) + (bias ? bias[n] : 0.0f);
        }
        for (int64_t b = 0; b < nb; b++) {
            k_dequant_block(type, w + n * nb * bs + b * bs, wf);
            for (int64_t i = 0; i < M; i++) {
                const float *xp = x + i * K + b * AE_QK;
                float s = 0.0f;
                for (int j = 0; j < AE_QK; j++) s = fmaf(wf[j], xp[j], s);
                out[i * ldo + n] += s;
            }
        }
    }
}

/* Rows [n0, n1) of out for every row of x. type and x8 must be compile-time constants (see gemm_run). */
static inline __attribute__((always_inline)) void gemm_chunk(const int type, const int x8, int64_t n0, int64_t n1,
                                                             const float *x, int64_t M, int64_t K, const uint8_t *w,
                                                             const float *xs, const float *bias, float *out,
                                                             int64_t ldo, int accumulate) {
    if (is_kquant(type)) {
        chunk_k_f32(type, n0, n1, x, M, K, w, bias, out, ldo, accumulate);
        return;
    }
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(type);
    for (int64_t m0 = 0; m0 < M; m0 += AE_Q_MB) {
        const int64_t mb = M - m0 < AE_Q_MB ? M - m0 : AE_Q_MB;
        const float *xt = x + m0 * K, *xst = xs ? xs + m0 * nb : NULL;
        for (int64_t n = n0; n < n1; n++) {
            float res[AE_Q_MB];
            const uint8_t *wr = x8 ? w + (n >> 3) * 8 * row_bytes : w + n * row_bytes;
            const int i = (int)(n & 7);
            switch (mb) {
                case 4: row_tile(type, x8, 4, wr, i, nb, xt, K, xst, res); break;
                case 3: row_tile(type, x8, 3, wr, i, nb, xt, K, xst, res); break;
                case 2: row_tile(type, x8, 2, wr, i, nb, xt, K, xst, res); break;
                default: row_tile(type, x8, 1, wr, i, nb, xt, K, xst, res); break;
            }
            const float bn = bias ? bias[n] : 0.0f;
            for (int64_t i = 0; i < mb; i++) {
                float *o = out + (m0 + i) * ldo + n;
                *o = accumulate ? *o + res[i] + bn : res[i] + bn;
            }
        }
    }
}

/* The switch on the type sits inside the parallel loop on purpose: GCC outlines an OpenMP region
 * once, before inlining, so a region inside an always_inline function typed by its caller runs with
 * the type as a run-time value (measured: 7-15% slower with one more run-time flag in the loop). */
static void gemm_run(int tx, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias,
                     float *out, int64_t ldo, int accumulate, int nthreads) {
    const int type = tx & ~AE_Q_X8;
    const int64_t nb = K / 32;
    float *xs = NULL; /* per (row of x, block) sums, for the m * sum(x) term */
    if (type != AE_Q_Q8_0 && !is_kquant(type)) {
        xs = (float *)malloc(sizeof(float) * (size_t)(M * nb > 0 ? M * nb : 1));
        for (int64_t i = 0; i < M; i++)
            for (int64_t b = 0; b < nb; b++) {
                float s = 0.0f;
                for (int j = 0; j < 32; j++) s += x[i * K + b * 32 + j];
                xs[i * nb + b] = s;
            }
    }
    const int64_t chunks = (N + AE_Q_CHUNK - 1) / AE_Q_CHUNK;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && chunks > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * AE_Q_CHUNK, n1 = n0 + AE_Q_CHUNK < N ? n0 + AE_Q_CHUNK : N;
#define AE_Q_CASE(t, f) \
    case t | f: gemm_chunk(t, f != 0, n0, n1, x, M, K, w, xs, bias, out, ldo, accumulate); break;
        switch (tx) {
            AE_Q_FOR_EACH_FORMAT(AE_Q_CASE)
        }
#undef AE_Q_CASE
    }
    free(xs);
}

/* out[m * ldo + n] (+)= sum_k x[m * K + k] * W[n, k] (+ bias[n]). K must be a multiple of 32; type may
 * carry AE_Q_X8 (then N must be a multiple of 8). Returns 0, or -1 for an unknown type. */
int ae_q_gemm(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias,
              float *out, int64_t ldo, int accumulate, int nthreads) {
    const int t = type & ~AE_Q_X8;
    if (!block_bytes(t) || K % block_len(t) || ((type & AE_Q_X8) && (N % 8 || is_kquant(t)))) return -1;
    gemm_run(type, x, M, K, w, N, bias, out, ldo, accumulate, nthreads);
    return 0;
}

/* Rows [r0, r1) of W (either layout) dequantized into out[(r - r0) * K + k] (the large-M path's fp32
 * tile and the embedding gather's building block). */
int ae_q_dequant(int type, const uint8_t *w, int64_t K, int64_t r0, int64_t r1, float *out, int nthreads) {
    const int x8 = (type & AE_Q_X8) != 0, t = type & ~AE_Q_X8, bs = block_bytes(t);
    if (!bs || K % block_len(t) || (x8 && is_kquant(t))) return -1;
    const int64_t nb = K / block_len(t), row_bytes = nb * bs;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && r1 - r0 > 64)
    for (int64_t r = r0; r < r1; r++) {
        if (is_kquant(t)) {
            for (int64_t b = 0; b < nb; b++) k_dequant_block(t, w + r * row_bytes + b * bs, out + (r - r0) * K + b * AE_QK);
            continue;
        }
        const ae_qrow q = qrow(t, x8, w, row_bytes, r);
        for (int64_t b = 0; b < nb; b++) dequant_block(t, &q, b, out + (r - r0) * K + b * 32);
    }
    return 0;
}

/* out[i, :] = dequant(W)[ids[i], :] for i < n (the quantized token embedding, either layout). Ids
 * are checked by the caller; returns -1 for an unknown type. */
int ae_q_embed(int type, const uint8_t *w, int64_t K, const int64_t *ids, int64_t n, float *out, int nthreads) {
    const int x8 = (type & AE_Q_X8) != 0, t = type & ~AE_Q_X8, bs = block_bytes(t);
    if (!bs || K % block_len(t) || (x8 && is_kquant(t))) return -1;
    const int64_t nb = K / block_len(t), row_bytes = nb * bs;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n > 64)
    for (int64_t i = 0; i < n; i++) {
        if (is_kquant(t)) {
            for (int64_t b = 0; b < nb; b++) k_dequant_block(t, w + ids[i] * row_bytes + b * bs, out + i * K + b * AE_QK);
            continue;
        }
        const ae_qrow q = qrow(t, x8, w, row_bytes, ids[i]);
        for (int64_t b = 0; b < nb; b++) dequant_block(t, &q, b, out + i * K + b * 32);
    }
    return 0;
}
