/* Weight-only quantized matmul on GGUF block formats (Q4_0, Q4_1, Q8_0), fp32 activations.
 *
 * out[M, N] (+)= x[M, K] @ dequant(W)[N, K]^T (+ bias[N])
 *
 * W is kept as the file's raw blocks, row-major: row n is K/32 blocks of
 *   Q8_0: fp16 d, int8 q[32]              -> w = d * q                  (34 bytes)
 *   Q4_0: fp16 d, u8 qs[16]               -> w = d * (q - 8)            (18 bytes)
 *   Q4_1: fp16 d, fp16 m, u8 qs[16]       -> w = d * q + m              (20 bytes)
 * (Q4: element j < 16 is the low nibble of qs[j], element 16 + j its high nibble.)
 *
 * Why the math is exact: per block we compute d * sum(q * x) + m * sum(x) (Q4_0: m = -8 d), which
 * is the dequantized dot product re-associated, so results equal x @ dequant(W)^T up to fp32
 * summation order (the tests hold it to that). ae_q_gemm quantizes no activation; ae_q_gemm_i8 (at the
 * end of this file) does, to int8 blocks, for integer dot products, on the instruction set chosen
 * at run time (portable C, AVX2, AVX512-VNNI: quant_i8.h).
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

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define AE_Q_X86 1 /* the int8 kernel's AVX2 and VNNI copies exist (chosen at run time) */
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define AE_Q_AVX2 1 /* the fp32 kernel's SIMD path (chosen at build time, -march=native) */
#endif

enum { AE_Q_Q4_0 = 2, AE_Q_Q4_1 = 3, AE_Q_Q8_0 = 8 }; /* GGML type ids */

#define AE_Q_CHUNK 16 /* rows of W per scheduling unit */
#define AE_Q_MB 4     /* rows of x per register tile */

static inline float fp16_to_fp32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline int block_bytes(int type) {
    return type == AE_Q_Q8_0 ? 34 : type == AE_Q_Q4_1 ? 20 : type == AE_Q_Q4_0 ? 18 : 0;
}

/* d, the additive term m (Q4_0: -8 d; Q8_0: 0) and the 32 quants of one block, as floats. */
static inline void block_scalar(int type, const uint8_t *b, float *d, float *m, float q[32]) {
    *d = fp16_to_fp32(b);
    if (type == AE_Q_Q8_0) {
        *m = 0.0f;
        for (int j = 0; j < 32; j++) q[j] = (float)(int8_t)b[2 + j];
        return;
    }
    const uint8_t *qs = b + (type == AE_Q_Q4_1 ? 4 : 2);
    *m = type == AE_Q_Q4_1 ? fp16_to_fp32(b + 2) : -8.0f * *d;
    for (int j = 0; j < 16; j++) {
        q[j] = (float)(qs[j] & 0x0F);
        q[j + 16] = (float)(qs[j] >> 4);
    }
}

/* One block dequantized exactly as the reference does it (q * d + m, or (q - 8) * d). */
static inline void dequant_block(int type, const uint8_t *b, float *out) {
    float d, m, q[32];
    block_scalar(type, b, &d, &m, q);
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

static inline __attribute__((always_inline)) void unpack(int type, const uint8_t *b, __m256 q[4]) {
    if (type == AE_Q_Q8_0) {
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i))));
        return;
    }
    /* The 16 bytes in both 128-bit lanes; one byte shuffle spreads bytes 0-7 (8-15) into the low
     * byte of each 32-bit lane: the low nibble is that & 15, the high nibble that >> 4. Two shuffles
     * per block instead of six (zero-extends): the shuffle port is what bounds decode here. */
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + (type == AE_Q_Q4_1 ? 4 : 2))));
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
static inline __attribute__((always_inline)) void row_tile(const int type, const int mb, const uint8_t *w,
                                                           int64_t nb, const float *x, int64_t ldx,
                                                           const float *xs, float *res) {
    const int bs = block_bytes(type);
    float macc[AE_Q_MB] = {0};
#if AE_Q_AVX2
    __m256 acc[AE_Q_MB];
    for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bs;
        __m256 q[4];
        unpack(type, blk, q);
        const float d = fp16_to_fp32(blk);
        const __m256 dv = _mm256_set1_ps(d);
        const float m = type == AE_Q_Q4_1 ? fp16_to_fp32(blk + 2) : -8.0f * d;
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
        block_scalar(type, w + b * bs, &d, &m, q);
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

static inline __attribute__((always_inline)) void gemm_typed(const int type, const float *x, int64_t M,
                                                             int64_t K, const uint8_t *w, int64_t N,
                                                             const float *bias, float *out, int64_t ldo,
                                                             int accumulate, int nthreads) {
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(type);
    float *xs = NULL; /* per (row of x, block) sums, for the m * sum(x) term */
    if (type != AE_Q_Q8_0) {
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
        for (int64_t m0 = 0; m0 < M; m0 += AE_Q_MB) {
            const int64_t mb = M - m0 < AE_Q_MB ? M - m0 : AE_Q_MB;
            const float *xt = x + m0 * K, *xst = xs ? xs + m0 * nb : NULL;
            for (int64_t n = n0; n < n1; n++) {
                float res[AE_Q_MB];
                const uint8_t *wr = w + n * row_bytes;
                switch (mb) {
                    case 4: row_tile(type, 4, wr, nb, xt, K, xst, res); break;
                    case 3: row_tile(type, 3, wr, nb, xt, K, xst, res); break;
                    case 2: row_tile(type, 2, wr, nb, xt, K, xst, res); break;
                    default: row_tile(type, 1, wr, nb, xt, K, xst, res); break;
                }
                const float bn = bias ? bias[n] : 0.0f;
                for (int64_t i = 0; i < mb; i++) {
                    float *o = out + (m0 + i) * ldo + n;
                    *o = accumulate ? *o + res[i] + bn : res[i] + bn;
                }
            }
        }
    }
    free(xs);
}

/* out[m * ldo + n] (+)= sum_k x[m * K + k] * W[n, k] (+ bias[n]). K must be a multiple of 32.
 * Returns 0, or -1 for an unknown type. */
int ae_q_gemm(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias,
              float *out, int64_t ldo, int accumulate, int nthreads) {
    if (K % 32) return -1;
    switch (type) {
        case AE_Q_Q4_0: gemm_typed(AE_Q_Q4_0, x, M, K, w, N, bias, out, ldo, accumulate, nthreads); return 0;
        case AE_Q_Q4_1: gemm_typed(AE_Q_Q4_1, x, M, K, w, N, bias, out, ldo, accumulate, nthreads); return 0;
        case AE_Q_Q8_0: gemm_typed(AE_Q_Q8_0, x, M, K, w, N, bias, out, ldo, accumulate, nthreads); return 0;
        default: return -1;
    }
}

/* Rows [r0, r1) of W dequantized into out[(r - r0) * K + k] (the large-M path's fp32 tile and the
 * embedding gather's building block). */
int ae_q_dequant(int type, const uint8_t *w, int64_t K, int64_t r0, int64_t r1, float *out, int nthreads) {
    const int bs = block_bytes(type);
    if (!bs || K % 32) return -1;
    const int64_t nb = K / 32, row_bytes = nb * bs;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && r1 - r0 > 64)
    for (int64_t r = r0; r < r1; r++)
        for (int64_t b = 0; b < nb; b++) dequant_block(type, w + r * row_bytes + b * bs, out + (r - r0) * K + b * 32);
    return 0;
}

/* out[i, :] = dequant(W)[ids[i], :] for i < n (the quantized token embedding). Ids are checked by
 * the caller; returns -1 for an unknown type. */
int ae_q_embed(int type, const uint8_t *w, int64_t K, const int64_t *ids, int64_t n, float *out, int nthreads) {
    const int bs = block_bytes(type);
    if (!bs || K % 32) return -1;
    const int64_t nb = K / 32, row_bytes = nb * bs;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n > 64)
    for (int64_t i = 0; i < n; i++)
        for (int64_t b = 0; b < nb; b++) dequant_block(type, w + ids[i] * row_bytes + b * bs, out + i * K + b * 32);
    return 0;
}

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
#include "quant_i8.h"
#undef AE_LVL
#undef AE_FN
#undef AE_TGT

#if AE_Q_X86
static inline int32_t load32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#define AE_LVL 1
#define AE_FN(name) AE_CAT(name, avx2)
#define AE_TGT __attribute__((target("avx2,fma,f16c")))
#include "quant_i8.h"
#undef AE_LVL
#undef AE_FN
#undef AE_TGT

#define AE_LVL 2
#define AE_FN(name) AE_CAT(name, vnni)
#define AE_TGT __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#include "quant_i8.h"
#undef AE_LVL
#undef AE_FN
#undef AE_TGT

static uint64_t xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

enum { AE_ISA_C = 0, AE_ISA_AVX2 = 1, AE_ISA_VNNI = 2 };

/* The best int8 path this CPU can execute (see above). */
int ae_q_cpu_isa(void) {
#if AE_Q_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return AE_ISA_C;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx || !fma || !f16c) return AE_ISA_C;
    const uint64_t x = xcr0();
    if ((x & 0x6) != 0x6) return AE_ISA_C; /* SSE + AVX state */
    if (__get_cpuid_max(0, 0) < 7) return AE_ISA_C;
    __cpuid_count(7, 0, a, b, c, d);
    if (!((b >> 5) & 1)) return AE_ISA_C; /* AVX2 */
    const int f = (b >> 16) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1, vnni = (c >> 11) & 1;
    if (f && bw && vl && vnni && (x & 0xE6) == 0xE6) return AE_ISA_VNNI; /* + opmask, ZMM state */
    return AE_ISA_AVX2;
#else
    return AE_ISA_C;
#endif
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

/* out (+)= x's int8 blocks (q, d, s as ae_q_quantize_act makes them) times dequant(W)^T (+ bias),
 * on the ISA in use: for callers that quantize a row once and multiply it by several weights. */
int ae_q_gemm_q8(int type, const int8_t *q, const float *d, const float *s, int64_t M, int64_t K,
                 const uint8_t *w, int64_t N, const float *bias, float *out, int64_t ldo, int accumulate,
                 int nthreads) {
    if (K % 32 || !block_bytes(type)) return -1;
    switch (ae_q_isa()) {
#if AE_Q_X86
        case AE_ISA_VNNI: gemm_i8_vnni(type, q, d, s, M, K, w, N, bias, out, ldo, accumulate, nthreads); break;
        case AE_ISA_AVX2: gemm_i8_avx2(type, q, d, s, M, K, w, N, bias, out, ldo, accumulate, nthreads); break;
#endif
        default: gemm_i8_c(type, q, d, s, M, K, w, N, bias, out, ldo, accumulate, nthreads); break;
    }
    return 0;
}

/* As ae_q_gemm, with x quantized to int8 blocks first (see above). Returns 0, or -1 for an unknown
 * type, K not a multiple of 32, or no memory for the int8 copy of x. */
int ae_q_gemm_i8(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias,
                 float *out, int64_t ldo, int accumulate, int nthreads) {
    if (K % 32 || !block_bytes(type)) return -1;
    const int64_t nb = K / 32;
    const size_t n = (size_t)(M * nb > 0 ? M * nb : 1);
    int8_t *q = (int8_t *)malloc(n * 32);
    float *ds = (float *)malloc(n * 2 * sizeof(float));
    if (!q || !ds) {
        free(q);
        free(ds);
        return -1;
    }
    quantize_rows(x, M, K, q, ds, ds + n);
    ae_q_gemm_q8(type, q, ds, ds + n, M, K, w, N, bias, out, ldo, accumulate, nthreads);
    free(q);
    free(ds);
    return 0;
}
