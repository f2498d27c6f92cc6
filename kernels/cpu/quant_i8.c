/* Quantized matmul with int8 activations (llama.cpp's trick), on the instruction set chosen at
 * run time. The weights: GGUF blocks in either layout of quant_common.h (rows, or x8 repacked).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"
#include "quant_common.h"
#include "quant_k.h"

#if defined(__x86_64__) || defined(__i386__)
#define AE_Q_X86 1 /* the int8 kernel's AVX2 and VNNI copies exist (chosen at run time) */
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define AE_Q_AVX2 1 /* the activation quantizer's SIMD path (chosen at build time, -march=native) */
#endif

/* ------------------------------------------------------------------------------------------------
 * int8 activations (llama.cpp's trick): each row of x is quantized once per call to blocks of 32,
 *   d = max|x| / 127, q = rint(x / d) in [-127, 127], s = d * sum(q),
 * and each (weight block, activation block) pair is an integer dot product:
 *   dot = dw * d * sum(qw * q) + m * s        (Q4_1: m the block's min; Q4_0: m = -8 dw; Q8_0: m = 0)
 * which is x's int8 rounding (q * d) times dequant(W) re-associated. Why: AVX2 does 32 u8 x s8
 * products in one maddubs where the fp32 path needs four FMAs plus four int->float conversions per
 * block, so the small-M kernel stops being bound by the FMA port. The cost: each x element moves by
 * at most d / 2 = max|x_block| / 254 (docs/quantization.md, "int8 activations").
 * ------------------------------------------------------------------------------------------------ */

#define AE_Q_MB8 4 /* rows of int8 x per register tile */

/* Row-major [M, K] fp32 -> q [M, K] int8, d and s [M, K / 32]. The rounding is rint (ties to even,
 * the default mode) of x * (1 / d) in fp32, which the torch reference reproduces bit for bit. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s) {
    const int64_t nb = K / 32;
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xp = x + i * K + b * 32;
            int8_t *qp = q + i * K + b * 32;
#if AE_Q_AVX2
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 v[4], amax = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(xp + 8 * j);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float dd = _mm_cvtss_f32(h) / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
            const __m256 idv = _mm256_set1_ps(id);
            __m256i qi[4];
            for (int j = 0; j < 4; j++) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], idv)); /* rint */
            /* pack 32 x int32 -> 32 x int8; packs interleave the 128-bit lanes, a permute restores order */
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)qp, p);
            const __m256i sum16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), p);
            const __m256i sum32 = _mm256_madd_epi16(sum16, _mm256_set1_epi16(1));
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
            d[i * nb + b] = dd;
            s[i * nb + b] = dd * (float)_mm_cvtsi128_si32(t);
#else
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xp[j]));
            const float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                qp[j] = (int8_t)lrintf(xp[j] * id);
                sum += qp[j];
            }
            d[i * nb + b] = dd;
            s[i * nb + b] = dd * (float)sum;
#endif
        }
}


/* ------------------------------------------------------------------------------------------------
 * The instruction set of the int8 kernel, chosen at run time (quant_i8.h holds one copy per ISA):
 * VNNI where the CPU reports AVX512-F/BW/VL + VNNI and the OS saves the AVX-512 state (XCR0 bits
 * 1, 2, 5, 6, 7: a CPU flag alone is not enough, a kernel or hypervisor may not grant the
 * registers), else AVX2 where it reports AVX2 + FMA + F16C and the OS saves the AVX state, else
 * portable C. ae_q_set_isa forces a lower one (tests run every path this CPU can execute).
 * ------------------------------------------------------------------------------------------------ */

#define AE_Q_NR 8  /* rows of W per int8 tile: one 8-lane float vector of results per row of x */
#define AE_Q_MC 64 /* rows of x whose accumulators a tile keeps (on the stack) */

#define AE_CAT2(a, b) a##_##b
#define AE_CAT(a, b) AE_CAT2(a, b)

#define AE_LVL 0
#define AE_FN(name) AE_CAT(name, c)
#define AE_TGT
#include "quant_x8.h"
#include "quant_k_isa.h"
#include "quant_i8.h"
#undef AE_LVL
#undef AE_FN
#undef AE_TGT

#if AE_Q_X86
static inline int64_t load64(const void *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline int32_t load32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#define AE_LVL 1
#define AE_FN(name) AE_CAT(name, avx2)
#define AE_TGT __attribute__((target("avx2,fma,f16c")))
#include "quant_x8.h"
#include "quant_k_isa.h"
#include "quant_i8.h"
#undef AE_LVL
#undef AE_FN
#undef AE_TGT

#define AE_LVL 2
#define AE_FN(name) AE_CAT(name, vnni)
#define AE_TGT __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#include "quant_x8.h"
#include "quant_k_isa.h"
#include "quant_i8.h"
#undef AE_LVL
#undef AE_FN
#undef AE_TGT

#endif

/* The int8 paths, named by the dense kernels' levels they need (isa.h): portable C, AVX2, and the
 * VNNI copy, which isa.c's AVX-512 level already requires (F/BW/VL/VNNI and the OS's ZMM state). */
enum { AE_Q_ISA_C = AE_ISA_SCALAR, AE_Q_ISA_AVX2 = AE_ISA_AVX2, AE_Q_ISA_VNNI = AE_ISA_AVX512 };

/* The best int8 path this CPU can execute: isa.c's one reading of cpuid + XCR0, capped at VNNI. */
int ae_q_cpu_isa(void) {
    const int level = ae_isa_cpu();
    return level > AE_Q_ISA_VNNI ? AE_Q_ISA_VNNI : level;
}

static int g_isa = -1; /* -1: not chosen yet */

/* The int8 path in use (chosen on first use). */
int ae_q_isa(void) {
    if (g_isa < 0) g_isa = ae_q_cpu_isa();
    return g_isa;
}

/* Use path `isa` (-1: the best this CPU can execute). Returns the path now in use, or -1 (and
 * changes nothing) where the CPU cannot execute the one asked for. */
int ae_q_set_isa(int isa) {
    const int best = ae_q_cpu_isa();
    if (isa < 0) isa = best;
    if (isa > best) return -1;
    g_isa = isa;
    return g_isa;
}

/* x [M, K] fp32 -> its int8 blocks: q [M, K], d [M, K / 32], s [M, K / 32] (what ae_q_gemm_i8 uses;
 * exported so the tests can hold the Python reference to it). Returns -1 unless K % 32 == 0. */
int ae_q_quantize_act(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s) {
    if (K % 32) return -1;
    quantize_rows(x, M, K, q, d, s);
    return 0;
}

/* A known format whose blocks fill K, x8 only for the 32-value formats and whole groups of 8 rows. */
static int weight_ok(int type, int64_t K, int64_t N) {
    const int t = type & ~AE_Q_X8;
    if (!block_bytes(t) || K % block_len(t)) return 0;
    return !(type & AE_Q_X8) || (!is_kquant(t) && N % 8 == 0);
}

/* x [M, K] fp32 -> q8_K blocks: q [M, K] int8, d [M, K / 256] (what ae_q_gemm_i8 multiplies a
 * K-quant weight with; exported for the tests). Returns -1 unless K % 256 == 0. */
int ae_q_quantize_act_k(const float *x, int64_t M, int64_t K, int8_t *q, float *d) {
    if (K % AE_QK) return -1;
    k_quantize_rows(x, M, K, q, d);
    return 0;
}

/* out (+)= x's int8 blocks (q, d, s as ae_q_quantize_act makes them; for a K-quant weight q and d
 * as ae_q_quantize_act_k makes them, s unused) times dequant(W)^T (+ bias),
 * on the ISA in use: for callers that quantize a row once and multiply it by several weights. */
int ae_q_gemm_q8(int type, const int8_t *q, const float *d, const float *s, int64_t M, int64_t K,
                 const uint8_t *w, int64_t N, const float *bias, float *out, int64_t ldo, int accumulate,
                 int nthreads) {
    if (!weight_ok(type, K, N)) return -1;
    switch (ae_q_isa()) {
#if AE_Q_X86
        case AE_Q_ISA_VNNI: return gemm_i8_vnni(type, q, d, s, M, K, w, N, bias, out, ldo, accumulate, nthreads);
        case AE_Q_ISA_AVX2: return gemm_i8_avx2(type, q, d, s, M, K, w, N, bias, out, ldo, accumulate, nthreads);
#endif
        default: return gemm_i8_c(type, q, d, s, M, K, w, N, bias, out, ldo, accumulate, nthreads);
    }
}

/* As ae_q_gemm, with x quantized to int8 blocks first (see above). Returns 0, or -1 for an unknown
 * type, K not a multiple of 32, or no memory for the int8 copy of x. */
int ae_q_gemm_i8(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias,
                 float *out, int64_t ldo, int accumulate, int nthreads) {
    if (!weight_ok(type, K, N)) return -1;
    const int64_t nb = K / 32;
    const size_t n = (size_t)(M * nb > 0 ? M * nb : 1);
    int8_t *q = (int8_t *)malloc(n * 32);
    float *ds = (float *)malloc(n * 2 * sizeof(float));
    if (!q || !ds) {
        free(q);
        free(ds);
        return -1;
    }
    if (is_kquant(type)) k_quantize_rows(x, M, K, q, ds); /* d per 256 (ds + n unused) */
    else quantize_rows(x, M, K, q, ds, ds + n);
    const int rc = ae_q_gemm_q8(type, q, ds, ds + n, M, K, w, N, bias, out, ldo, accumulate, nthreads);
    free(q);
    free(ds);
    return rc;
}

/* x [M, K] -> what a weight of `type` multiplies with: q [M, K] int8 and d, s, xsum [M, K / 32] (a
 * K-quant: q8_K blocks, d per 256, s unused; xsum: per-32 sums of q where the x8 layout or a
 * K-quant needs them). For callers of ae_q_rows_q8. Returns -1 for a K the format cannot take. */
int ae_q_prepare_act(int type, const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s, int32_t *xsum) {
    if (!weight_ok(type, K, type & AE_Q_X8 ? 8 : 1)) return -1;
    if (is_kquant(type & ~AE_Q_X8)) k_quantize_rows(x, M, K, q, d);
    else quantize_rows(x, M, K, q, d, s);
    if ((type & AE_Q_X8) || is_kquant(type & ~AE_Q_X8))
        for (int64_t i = 0; i < M * (K / 32); i++) {
            int32_t t = 0;
            for (int j = 0; j < 32; j++) t += q[i * 32 + j];
            xsum[i] = t;
        }
    return 0;
}

/* Rows [n0, n1) of out = x (prepared by ae_q_prepare_act for this type) times dequant(W)^T, on the
 * calling thread (no OpenMP region: the caller shares row ranges out itself). n0 and n1 multiples
 * of 8 (or n1 = N), so every row is computed as the whole GEMM computes it. */
int ae_q_rows_q8(int type, const int8_t *q, const float *d, const float *s, const int32_t *xsum, int64_t M,
                 int64_t K, const uint8_t *w, int64_t N, int64_t n0, int64_t n1, float *out, int64_t ldo) {
    if (!weight_ok(type, K, N) || n0 < 0 || n1 > N || n0 > n1) return -1;
    switch (ae_q_isa()) {
#if AE_Q_X86
        case AE_Q_ISA_VNNI: rows_i8_vnni(type, q, d, s, xsum, M, K, w, N, n0, n1, out, ldo); break;
        case AE_Q_ISA_AVX2: rows_i8_avx2(type, q, d, s, xsum, M, K, w, N, n0, n1, out, ldo); break;
#endif
        default: rows_i8_c(type, q, d, s, xsum, M, K, w, N, n0, n1, out, ldo); break;
    }
    return 0;
}
