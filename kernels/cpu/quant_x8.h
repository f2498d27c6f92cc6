/* The int8-activation GEMM on weights in the x8 layout (quant_common.h), one copy per SIMD level:
 * quant_i8.c includes it before quant_i8.h with AE_LVL / AE_FN / AE_TGT set (see there).
 *
 * Per block of a group of 8 rows the weights are 4 vectors v (elements 8v..8v+7 of the 8 rows,
 * row r in bytes 8r..8r+7), the activation chunk x[8v..8v+7] is broadcast to every 64-bit lane,
 * and one u8 x s8 dot product (vpdpbusd on 512 bits; maddubs + madd on two 256-bit halves) adds
 * 8 rows' partial sums. The two int32 halves of a 64-bit lane are added once per block, and the
 * float work (int -> float, the two scales, the min term) is one 8-lane vector op per block for 8
 * rows: what the row layout spent on gathering 8 rows' scales and an 8x8 transpose-and-add
 * (quant_i8.h: load8, reduce8) is gone.
 *
 * The same bits as the row layout's SIMD kernel and the portable row_i8: per row and block the
 * integer dot product is exact, then acc = fma(float(isum), dw * dx, acc); acc = fma(m, sx, acc),
 * in block order, whatever M is (batch invariance).
 *
 * Q8_0: vpdpbusd wants one unsigned operand: the weights as w + 128 (one xor), and 128 * sum(x
 * block) (xsum, exact) subtracted after; AVX2's maddubs would saturate on that (2 * 255 * 127),
 * so there the signs move onto x as in quant_i8.h (|w| <= 128).
 */

/* Software prefetch this far ahead of the block in use (up to the weight's end): on one Zen 5 thread
 * streaming the default model's 120 projections from memory, 0 B: 2.49-2.67 ms (25-27 GB/s), 4 KB:
 * 2.41, 16 KB: 2.18 (30.5 GB/s), 24 KB: 2.11, 48 KB: 2.27; the Q8_0 head 0.74-0.81 -> 0.56-0.59 ms
 * (51 GB/s: the hardware prefetcher alone leaves a third of the bandwidth unused). */
#ifndef AE_X8_PF
#define AE_X8_PF 16384
#endif
#if AE_LVL >= 1
#if AE_LVL >= 2
typedef struct {
    __m512i v;
} AE_FN(x8w);
#else
typedef struct {
    __m256i h[2], u[2]; /* rows 0-3 and 4-7; u: the unsigned operand (Q8_0: |w|) */
} AE_FN(x8w);
#endif

/* Block blk of a group: the 4 weight vectors, the 8 rows' scales dw and min terms m. */
static inline AE_TGT __attribute__((always_inline)) void AE_FN(x8_load)(const int type, const uint8_t *blk,
                                                                      AE_FN(x8w) wv[4], __m256 *dw, __m256 *m) {
    *dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    if (type == AE_Q_Q4_1) *m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
    if (type == AE_Q_Q4_0) *m = _mm256_mul_ps(*dw, _mm256_set1_ps(-8.0f));
#if AE_LVL >= 2
    if (type == AE_Q_Q8_0) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int v = 0; v < 4; v++) wv[v].v = _mm512_xor_si512(_mm512_loadu_si512(blk + 16 + 64 * v), flip);
        return;
    }
    /* chunk 0 (qs[0..7]): low nibbles = elements 0-7, high = 16-23; chunk 1: 8-15 and 24-31 */
    const uint8_t *qs = blk + (type == AE_Q_Q4_1 ? 32 : 16);
    const __m512i lo = _mm512_set1_epi8(0x0F), p0 = _mm512_loadu_si512(qs), p1 = _mm512_loadu_si512(qs + 64);
    wv[0].v = _mm512_and_si512(p0, lo);
    wv[1].v = _mm512_and_si512(p1, lo);
    wv[2].v = _mm512_and_si512(_mm512_srli_epi16(p0, 4), lo);
    wv[3].v = _mm512_and_si512(_mm512_srli_epi16(p1, 4), lo);
#else
    if (type == AE_Q_Q8_0) {
        for (int v = 0; v < 4; v++)
            for (int h = 0; h < 2; h++) {
                wv[v].h[h] = _mm256_loadu_si256((const __m256i *)(blk + 16 + 64 * v + 32 * h));
                wv[v].u[h] = _mm256_sign_epi8(wv[v].h[h], wv[v].h[h]);
            }
        return;
    }
    const uint8_t *qs = blk + (type == AE_Q_Q4_1 ? 32 : 16);
    const __m256i lo = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
        const __m256i p0 = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
        const __m256i p1 = _mm256_loadu_si256((const __m256i *)(qs + 64 + 32 * h));
        wv[0].h[h] = wv[0].u[h] = _mm256_and_si256(p0, lo);
        wv[1].h[h] = wv[1].u[h] = _mm256_and_si256(p1, lo);
        wv[2].h[h] = wv[2].u[h] = _mm256_and_si256(_mm256_srli_epi16(p0, 4), lo);
        wv[3].h[h] = wv[3].u[h] = _mm256_and_si256(_mm256_srli_epi16(p1, 4), lo);
    }
#endif
}

/* The 8 rows' exact integer dot products with one int8 block of x (xq; xsum = its sum, Q8_0). */
static inline AE_TGT __attribute__((always_inline)) __m256i AE_FN(x8_isum)(const int type, const AE_FN(x8w) wv[4],
                                                                         const int8_t *xq, int32_t xsum) {
#if AE_LVL >= 2
    __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0].v, _mm512_set1_epi64(load64(xq)));
    for (int v = 1; v < 4; v++) acc = _mm512_dpbusd_epi32(acc, wv[v].v, _mm512_set1_epi64(load64(xq + 8 * v)));
    /* 64-bit lane r holds row r's two halves: add them in the low dword, keep that */
    __m256i r = _mm512_cvtepi64_epi32(_mm512_add_epi32(acc, _mm512_srli_epi64(acc, 32)));
    if (type == AE_Q_Q8_0) r = _mm256_sub_epi32(r, _mm256_set1_epi32(128 * xsum));
    return r;
#else
    (void)xsum;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int v = 0; v < 4; v++) {
        const __m256i xv = _mm256_set1_epi64x(load64(xq + 8 * v));
        for (int h = 0; h < 2; h++) {
            const __m256i xo = type == AE_Q_Q8_0 ? _mm256_sign_epi8(xv, wv[v].h[h]) : xv;
            acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(_mm256_maddubs_epi16(wv[v].u[h], xo), ones));
        }
    }
    /* int32 lane L of half h is row 4h + L/2: pairwise adds give rows 0 1 4 5 2 3 6 7 */
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[0], acc[1]), _MM_SHUFFLE(3, 1, 2, 0));
#endif
}

static inline AE_TGT __attribute__((always_inline)) __m256 AE_FN(x8_acc)(const int type, __m256i isum, __m256 dw,
                                                                       __m256 m, float dx, float sx, __m256 acc) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc);
    return type == AE_Q_Q8_0 ? acc : _mm256_fmadd_ps(m, _mm256_set1_ps(sx), acc);
}

/* acc[8 i + r] = row r of the group at grp times int8 row i of x, for mc rows of x. fixed (1-4, a
 * compile-time constant) keeps the accumulators in registers; 0 = through acc (as tile8). */
static inline AE_TGT __attribute__((always_inline)) void AE_FN(tile_x8)(const int type, const int fixed,
                                                                      const uint8_t *grp, int64_t nb, const int8_t *q,
                                                                      int64_t K, const float *d, const float *s,
                                                                      const int32_t *xsum, int64_t mc, float *acc,
                                                                      const uint8_t *wend) {
    const int64_t gb = 8 * (int64_t)block_bytes(type);
    AE_FN(x8w) wv[4];
    __m256 dw, m = _mm256_setzero_ps();
    if (fixed) {
        __m256 av[4];
        for (int i = 0; i < fixed; i++) av[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *pf = grp + b * gb + AE_X8_PF;
            if (pf < wend)
                for (int64_t off = 0; off < gb; off += 64) _mm_prefetch((const char *)(pf + off), _MM_HINT_T0);
            AE_FN(x8_load)(type, grp + b * gb, wv, &dw, &m);
            for (int i = 0; i < fixed; i++)
                av[i] = AE_FN(x8_acc)(type, AE_FN(x8_isum)(type, wv, q + i * K + b * 32, xsum[i * nb + b]), dw, m,
                                      d[i * nb + b], s[i * nb + b], av[i]);
        }
        for (int i = 0; i < fixed; i++) _mm256_store_ps(acc + 8 * i, av[i]);
        return;
    }
    for (int64_t i = 0; i < mc; i++) _mm256_store_ps(acc + 8 * i, _mm256_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pf = grp + b * gb + AE_X8_PF;
        if (pf < wend)
            for (int64_t off = 0; off < gb; off += 64) _mm_prefetch((const char *)(pf + off), _MM_HINT_T0);
        AE_FN(x8_load)(type, grp + b * gb, wv, &dw, &m);
        for (int64_t i = 0; i < mc; i++)
            _mm256_store_ps(acc + 8 * i,
                            AE_FN(x8_acc)(type, AE_FN(x8_isum)(type, wv, q + i * K + b * 32, xsum[i * nb + b]), dw, m,
                                          d[i * nb + b], s[i * nb + b], _mm256_load_ps(acc + 8 * i)));
    }
}
#endif /* AE_LVL >= 1 */
