/* The K-quant GEMM with q8_K activations (quant_k.h), one copy per instruction set: quant_i8.c
 * includes this file once per ISA (AE_LVL, AE_FN, AE_TGT as for quant_i8.h), and quant_i8.h's
 * chunk_i8 hands a K-quant chunk to AE_FN(chunk_k).
 *
 * Per (weight row, super-block): the 256 weights are decoded once into 8 vectors of 32 bytes
 * (element order) and serve every row of the x tile; per 32-value sub-block the u8 x s8 products
 * are summed in pairs (maddubs: no saturation at these ranges, |w| <= 32 or 31, |x| <= 127) and
 * weighted by the sub-block's scale in the same instruction (madd_epi16 against the scale), so the
 * super-block's integer sum needs one horizontal add. Every path computes the same integers and
 * then the same scalar float code (k_combine): bit-identical across ISAs.
 */

#if AE_LVL >= 1
/* The super-block's weights as 8 x 32 bytes (sub-block j = w[j]): Q4_K/Q5_K unsigned 0..31;
 * Q6_K q - 32 as s8 (wu: |w|, for the u8 operand). scl[j]: the 16-bit scale of each pair of
 * products (Q6_K: two scales per 32 values, one per 16). */
static inline AE_TGT __attribute__((always_inline)) void AE_FN(k_load)(const int type, const uint8_t *blk,
                                                                     const uint8_t sc[8], __m256i w[8],
                                                                     __m256i wu[8], __m256i scl[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (type == AE_Q_Q6_K) {
        const __m256i m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
        /* the 16 scales as int16; dword j = scales 2j, 2j + 1: broadcast it, then spread scale 2j over
         * the low 128 bits (products 0-15) and 2j + 1 over the high ones (16-31) */
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                                2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qhp = blk + 128 + 32 * h;
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)qhp);
            const __m256i hb[4] = {_mm256_and_si256(qh, m2), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2),
                                   _mm256_and_si256(_mm256_srli_epi16(qh, 4), m2),
                                   _mm256_and_si256(_mm256_srli_epi16(qh, 6), m2)};
            const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                                   _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
            for (int k = 0; k < 4; k++) {
                const int j = 4 * h + k;
                w[j] = _mm256_sub_epi8(_mm256_or_si256(lo[k], _mm256_slli_epi16(hb[k], 4)), off);
                wu[j] = _mm256_abs_epi8(w[j]);
                scl[j] = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(s16, _mm256_set1_epi32(j)), spread);
            }
        }
        return;
    }
    const uint8_t *qs = blk + (type == AE_Q_Q5_K ? 48 : 16);
    __m256i qh = _mm256_setzero_si256();
    if (type == AE_Q_Q5_K) qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
    const __m256i one = _mm256_set1_epi8(1);
    for (int g = 0; g < 4; g++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
        w[2 * g] = _mm256_and_si256(v, m4);
        w[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (type == AE_Q_Q5_K) {
            const __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one);
            const __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one);
            w[2 * g] = _mm256_or_si256(w[2 * g], _mm256_slli_epi16(b0, 4));
            w[2 * g + 1] = _mm256_or_si256(w[2 * g + 1], _mm256_slli_epi16(b1, 4));
        }
    }
    /* the 8 scales as int16 in both halves; sub-block j's spread over all lanes by one shuffle */
    int64_t s8;
    memcpy(&s8, sc, 8);
    const __m256i s16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(s8)));
    for (int j = 0; j < 8; j++) {
        wu[j] = w[j];
        scl[j] = _mm256_shuffle_epi8(s16, _mm256_set1_epi16((int16_t)(0x0100 + 0x0202 * j)));
    }
}

/* sum_j scale_j * (w_j . x_j) over the super-block, exactly (int32). */
static inline AE_TGT __attribute__((always_inline)) int32_t AE_FN(k_dot)(const int type, const __m256i w[8],
                                                                       const __m256i wu[8], const __m256i scl[8],
                                                                       const int8_t *xq) {
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * j));
        if (type == AE_Q_Q6_K) x = _mm256_sign_epi8(x, w[j]); /* |w| * sign(w) x */
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(wu[j], x), scl[j]));
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(t);
}
#endif

#define AE_K_MB 4 /* rows of x per tile: each decoded super-block serves all of them */
#ifndef AE_K_PF
#define AE_K_PF 16384 /* bytes of the weight stream prefetched ahead (as the x8 kernel: AE_X8_PF) */
#endif

/* res[i] = row n of W (its nb super-blocks at wr) times q8_K row i of x, for mb rows. */
static inline AE_TGT __attribute__((always_inline)) void AE_FN(k_row)(const int type, const int mb,
                                                                    const uint8_t *wr, int64_t nb, const int8_t *q,
                                                                    int64_t K, const float *d, const int32_t *xsum,
                                                                    float *res, const uint8_t *wend) {
    const int bs = block_bytes(type);
    float acc[AE_K_MB] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wr + b * bs;
        if (blk + AE_K_PF < wend) /* the hardware prefetcher alone leaves DRAM bandwidth unused */
            for (int off = 0; off < bs; off += 64) __builtin_prefetch(blk + AE_K_PF + off, 0, 3);
#if AE_LVL >= 1
        __m256i w[8], wu[8], scl[8];
        uint8_t s8[8] = {0}, m8[8] = {0};
        if (type != AE_Q_Q6_K) k4_scales(blk + 4, s8, m8);
        AE_FN(k_load)(type, blk, s8, w, wu, scl);
#else
        int sc[16], m[8];
        int8_t wq[AE_QK];
        float dd, dm;
        k_decode(type, blk, wq, sc, m, &dd, &dm);
#endif
        for (int i = 0; i < mb; i++) {
            const int8_t *xq = q + i * K + b * AE_QK;
            int32_t sumi = 0, summ = 0;
#if AE_LVL >= 1
            sumi = AE_FN(k_dot)(type, w, wu, scl, xq);
#else
            const int sub = type == AE_Q_Q6_K ? 16 : 32;
            for (int j = 0; j < AE_QK / sub; j++) {
                int32_t t = 0;
                for (int l = 0; l < sub; l++) t += wq[sub * j + l] * xq[sub * j + l];
                sumi += sc[j] * t;
            }
#endif
            if (type != AE_Q_Q6_K) {
                const int32_t *xs = xsum + (i * K + b * AE_QK) / 32;
#if AE_LVL >= 1
                { /* the 8 mins times the 8 sub-block sums of x, in one vector (the scalar loop cost
                   * 10% of a Q4_K GEMV at M = 1: 45 -> 41 us on 1024 x 1024, one thread) */
                    int64_t m64;
                    memcpy(&m64, m8, 8);
                    const __m256i p = _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)xs),
                                                         _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(m64)));
                    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
                    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
                    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
                    summ = _mm_cvtsi128_si32(t);
                }
#else
                for (int j = 0; j < 8; j++) summ += m[j] * xs[j];
#endif
            }
            acc[i] = k_combine(blk, type, d[i * (K / AE_QK) + b], sumi, summ, acc[i]);
        }
    }
    for (int i = 0; i < mb; i++) res[i] = acc[i];
}

/* Rows [n0, n1) of out for every row of x (type a compile-time constant: see chunk_i8). */
static inline AE_TGT __attribute__((always_inline)) void AE_FN(chunk_k)(
    const int type, int64_t n0, int64_t n1, const int8_t *q, const float *d, const int32_t *xsum, int64_t M,
    int64_t K, const uint8_t *w, int64_t N, const float *bias, float *out, int64_t ldo, int accumulate) {
    const int64_t nb = K / AE_QK, row_bytes = nb * block_bytes(type);
    const uint8_t *wend = w + N * row_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += AE_K_MB) {
        const int64_t mb = M - m0 < AE_K_MB ? M - m0 : AE_K_MB;
        const int8_t *qt = q + m0 * K;
        const float *dt = d + m0 * nb;
        const int32_t *xt = xsum + m0 * (K / 32);
        for (int64_t n = n0; n < n1; n++) {
            float res[AE_K_MB];
            const uint8_t *wr = w + n * row_bytes;
            switch (mb) {
                case 4: AE_FN(k_row)(type, 4, wr, nb, qt, K, dt, xt, res, wend); break;
                case 3: AE_FN(k_row)(type, 3, wr, nb, qt, K, dt, xt, res, wend); break;
                case 2: AE_FN(k_row)(type, 2, wr, nb, qt, K, dt, xt, res, wend); break;
                default: AE_FN(k_row)(type, 1, wr, nb, qt, K, dt, xt, res, wend); break;
            }
            const float bn = bias ? bias[n] : 0.0f;
            for (int64_t i = 0; i < mb; i++) {
                float *o = out + (m0 + i) * ldo + n;
                *o = accumulate ? *o + res[i] + bn : res[i] + bn;
            }
        }
    }
}
