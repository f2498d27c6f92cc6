/* Batch-invariant dense matmul: out[m, n] = x[m, :] . W[n, :] (+ bias[n]) for float32 or bfloat16,
 * where each output's arithmetic is one fixed sequence of operations that depends on K alone.
 *
 * Why: a BLAS (oneDNN, MKL) picks its blocking, its micro-kernel and sometimes a split of K over
 * threads from M, so the same row of x multiplied alone and in a batch of 40 can round differently
 * (asyncengine issue 24: 9 distinct outputs of one request in fp32). Here every output is
 *   16 lanes (fp32: lane l sums the products k = l mod 16; bf16 with AVX512-BF16: lane l sums the
 *   pairs 2l, 2l+1 of each 32-wide chunk) accumulated in increasing k, a masked zero-filled tail,
 *   then one fixed reduction of the 16 lanes, then + bias, then one rounding to the dtype;
 * whatever M, whichever tile the output falls in (4 x 6, 1 x 6, 4 x 1, 1 x 1 share the code), and
 * whichever thread computes it: threads split W's rows (N), never K. So the bits of a row depend on
 * that row, W, K and the machine's SIMD path: not on M, the other rows, or the thread count.
 *
 * Speed: the register tile is 4 rows of x by 6 rows of W (24 zmm accumulators); W is walked in
 * chunks that stay in L2 while every tile of x passes over them, so decode (M = 1) streams W once
 * from memory like a gemv and prefill re-reads it from cache. Without AVX-512 the same contract
 * holds with a portable 16-lane loop (slower; the compiler vectorises the lanes).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define INV_MR 4     /* rows of x per register tile */
#define INV_NR 6     /* rows of W per register tile */
#define INV_LANES 16 /* fp32 lanes per accumulator (one zmm) */
#define INV_L2_BYTES (384 * 1024) /* bytes of W one chunk keeps in L2 */

static inline float inv_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion. */
static inline uint16_t inv_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void inv_store(void *out, long i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)out)[i] = inv_f32_to_bf16(v);
    else
        ((float *)out)[i] = v;
}

static inline float inv_load(const void *p, long i, int bf16) {
    return bf16 ? inv_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if defined(__AVX512F__)
/* The one reduction of 16 lanes every output goes through: halves added pairwise, fixed order. */
static inline float inv_hsum(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

/* 16 elements from k (bf16: widened exactly), zeros past kmax. */
static inline __m512 inv_ld16(const void *p, long k, long kmax, int bf16) {
    long n = kmax - k;
    __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    if (bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + k);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)p + k);
}

static inline __m512 inv_ld16_full(const void *p, long k, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + k))), 16));
    return _mm512_loadu_ps((const float *)p + k);
}

#if defined(__AVX512BF16__)
/* 32 bf16 elements from k as a dot-product operand, zeros past kmax. */
static inline __m512bh inv_ld32bh(const uint16_t *p, long k, long kmax) {
    long n = kmax - k;
    __mmask32 m = n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1u);
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p + k);
}
#endif

/* out tile [mr x nr] at (x rows xs, W rows ws). mr, nr, bf16 are compile-time constants at every
 * call site; every accumulator sees the same sequence whatever mr and nr are. */
static inline __attribute__((always_inline)) void inv_tile(const int mr, const int nr, const int bf16,
                                                           const void *x, long ldx, const void *w, long K,
                                                           const void *bias, void *out, long ldo, long m0, long n0) {
    __m512 acc[INV_MR][INV_NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if (bf16) {
        const uint16_t *xb = (const uint16_t *)x, *wb = (const uint16_t *)w;
        long k = 0;
        for (; k + 32 <= K; k += 32) { /* whole chunks: plain loads (a full mask, the same values) */
            __m512bh xv[INV_MR];
            for (int i = 0; i < mr; i++) xv[i] = (__m512bh)_mm512_loadu_si512(xb + (m0 + i) * ldx + k);
            for (int j = 0; j < nr; j++) {
                __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + (n0 + j) * K + k);
                for (int i = 0; i < mr; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
            }
        }
        if (k < K) { /* the tail, zero-filled */
            __m512bh xv[INV_MR];
            for (int i = 0; i < mr; i++) xv[i] = inv_ld32bh(xb + (m0 + i) * ldx, k, K);
            for (int j = 0; j < nr; j++) {
                __m512bh wv = inv_ld32bh(wb + (n0 + j) * K, k, K);
                for (int i = 0; i < mr; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
            }
        }
    } else
#endif
    {
        const int esz = bf16 ? 2 : 4;
        long k = 0;
        for (; k + 16 <= K; k += 16) { /* whole chunks: plain loads (a full mask, the same values) */
            __m512 xv[INV_MR];
            for (int i = 0; i < mr; i++) xv[i] = inv_ld16_full((const char *)x + (m0 + i) * ldx * esz, k, bf16);
            for (int j = 0; j < nr; j++) {
                __m512 wv = inv_ld16_full((const char *)w + (n0 + j) * K * esz, k, bf16);
                for (int i = 0; i < mr; i++) acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
            }
        }
        if (k < K) { /* the tail, zero-filled */
            __m512 xv[INV_MR];
            for (int i = 0; i < mr; i++) xv[i] = inv_ld16((const char *)x + (m0 + i) * ldx * esz, k, K, bf16);
            for (int j = 0; j < nr; j++) {
                __m512 wv = inv_ld16((const char *)w + (n0 + j) * K * esz, k, K, bf16);
                for (int i = 0; i < mr; i++) acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float v = inv_hsum(acc[i][j]);
            if (bias) v += inv_load(bias, n0 + j, bf16);
            inv_store(out, (m0 + i) * ldo + n0 + j, v, bf16);
        }
}
#else
/* Portable: the same contract (16 lanes over k mod 16, a fixed lane reduction), plain C. */
static inline __attribute__((always_inline)) void inv_tile(const int mr, const int nr, const int bf16,
                                                           const void *x, long ldx, const void *w, long K,
                                                           const void *bias, void *out, long ldo, long m0, long n0) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float acc[INV_LANES] = {0};
            const long xo = (m0 + i) * ldx, wo = (n0 + j) * K;
            long k = 0;
            for (; k + INV_LANES <= K; k += INV_LANES)
                for (int l = 0; l < INV_LANES; l++)
                    acc[l] += inv_load(x, xo + k + l, bf16) * inv_load(w, wo + k + l, bf16);
            for (int l = 0; k + l < K; l++) acc[l] += inv_load(x, xo + k + l, bf16) * inv_load(w, wo + k + l, bf16);
            for (int h = INV_LANES / 2; h > 0; h /= 2)
                for (int l = 0; l < h; l++) acc[l] += acc[l + h];
            float v = acc[0];
            if (bias) v += inv_load(bias, n0 + j, bf16);
            inv_store(out, (m0 + i) * ldo + n0 + j, v, bf16);
        }
}
#endif

static inline __attribute__((always_inline)) void inv_linear_typed(const int bf16, const void *x, long ldx,
                                                                   const void *w, const void *bias, void *out,
                                                                   long M, long N, long K, int nthreads) {
    const long esz = bf16 ? 2 : 4;
    long chunk = INV_L2_BYTES / (K * esz > 0 ? K * esz : 1);
    chunk = chunk / INV_NR * INV_NR;
    if (chunk < INV_NR) chunk = INV_NR;
    long chunks = (N + chunk - 1) / chunk;
    /* decode reads W once: let every thread have a share even where W fits one chunk */
    if (chunks < nthreads && N >= (long)nthreads * INV_NR) {
        chunk = (N + nthreads - 1) / nthreads;
        chunk = (chunk + INV_NR - 1) / INV_NR * INV_NR;
        chunks = (N + chunk - 1) / chunk;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && chunks > 1)
    for (long c = 0; c < chunks; c++) {
        const long n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        long m = 0;
        for (; m + INV_MR <= M; m += INV_MR) {
            long n = n0;
            for (; n + INV_NR <= n1; n += INV_NR) inv_tile(INV_MR, INV_NR, bf16, x, ldx, w, K, bias, out, N, m, n);
            for (; n < n1; n++) inv_tile(INV_MR, 1, bf16, x, ldx, w, K, bias, out, N, m, n);
        }
        for (; m < M; m++) {
            long n = n0;
            for (; n + INV_NR <= n1; n += INV_NR) inv_tile(1, INV_NR, bf16, x, ldx, w, K, bias, out, N, m, n);
            for (; n < n1; n++) inv_tile(1, 1, bf16, x, ldx, w, K, bias, out, N, m, n);
        }
    }
}

/* out [M, N] contiguous = x [M, K] (rows ldx elements apart) @ w [N, K]^T (+ bias [N]); all of one
 * dtype, float32 (bf16 = 0) or bfloat16 (bf16 = 1). nthreads: OpenMP threads over W's rows. */
void ae_inv_linear(const void *x, long ldx, const void *w, const void *bias, void *out, long M, long N, long K,
                   int bf16, int nthreads) {
    if (bf16)
        inv_linear_typed(1, x, ldx, w, bias, out, M, N, K, nthreads);
    else
        inv_linear_typed(0, x, ldx, w, bias, out, M, N, K, nthreads);
}
