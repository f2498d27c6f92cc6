/* The int8-activation GEMM of quant_i8.c, one copy per instruction set (quant_i8.c includes this file
 * once per ISA, the caller picks the copy at run time: ae_q_isa / ae_q_set_isa). Before each
 * inclusion quant_i8.c defines
 *   AE_LVL  0 portable C, 1 AVX2 (maddubs + madd), 2 AVX512-VNNI (vpdpbusd on 256-bit vectors)
 *   AE_FN   name -> name_<isa>           AE_TGT  the target attribute of that ISA (empty for C)
 *
 * Why 256-bit vectors with VNNI too: a weight block is 32 bytes, one ymm register; AMD's Zen 4
 * runs 512-bit integer ops as two 256-bit halves, and the reduction of 8 rows per tile (below)
 * already amortizes the per-block float work over 8 outputs. vpdpbusd fuses maddubs + madd (and
 * cannot saturate; the AVX2 pair does not either at these ranges: |w| <= 128 times |x| <= 127,
 * twice, < 32767), so both SIMD copies give bit-identical results.
 *
 * Batch invariance: the result of one row of x depends on that row alone (per row the blocks are
 * summed in the same order whatever M is), so a request's logits do not change with the batch.
 */

#if AE_LVL >= 1
static inline AE_TGT __attribute__((always_inline)) float AE_FN(hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The weight block as 32 bytes in element order: Q4 nibbles as u8 0..15, Q8_0 as s8. */
static inline AE_TGT __attribute__((always_inline)) __m256i AE_FN(weight_bytes)(int type, const uint8_t *b) {
    if (type == AE_Q_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + (type == AE_Q_Q4_1 ? 4 : 2)));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* int32 lanes whose sum is the dot product of u8 a with s8 b (32 pairs). */
static inline AE_TGT __attribute__((always_inline)) __m256i AE_FN(dot_u8s8)(__m256i a, __m256i b) {
#if AE_LVL >= 2
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

/* The fp16 pairs at the start of 8 blocks (p, p + stride, ...) as floats: *d = bytes 0-1 of each,
 * *m = bytes 2-3 (Q4_1's min; unused otherwise). One dword load per block, no store/reload. */
static inline AE_TGT __attribute__((always_inline)) void AE_FN(fp16x8_pairs)(const uint8_t *p, int64_t stride,
                                                                           __m256 *d, __m256 *m) {
    const __m256i v = _mm256_setr_epi32(load32(p), load32(p + stride), load32(p + 2 * stride),
                                        load32(p + 3 * stride), load32(p + 4 * stride), load32(p + 5 * stride),
                                        load32(p + 6 * stride), load32(p + 7 * stride));
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    /* per lane: 4 d then 4 m; the permute puts the 8 d in the low half, the 8 m in the high half */
    const __m256i dm = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, split), _MM_SHUFFLE(3, 1, 2, 0));
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
}

/* Lane r = the sum of the 8 int32 lanes of p[r] (an 8x8 transpose-and-add). */
static inline AE_TGT __attribute__((always_inline)) __m256i AE_FN(reduce8)(const __m256i p[8]) {
    __m256i a0 = _mm256_add_epi32(_mm256_unpacklo_epi32(p[0], p[1]), _mm256_unpackhi_epi32(p[0], p[1]));
    __m256i a1 = _mm256_add_epi32(_mm256_unpacklo_epi32(p[2], p[3]), _mm256_unpackhi_epi32(p[2], p[3]));
    __m256i a2 = _mm256_add_epi32(_mm256_unpacklo_epi32(p[4], p[5]), _mm256_unpackhi_epi32(p[4], p[5]));
    __m256i a3 = _mm256_add_epi32(_mm256_unpacklo_epi32(p[6], p[7]), _mm256_unpackhi_epi32(p[6], p[7]));
    __m256i b0 = _mm256_add_epi32(_mm256_unpacklo_epi64(a0, a1), _mm256_unpackhi_epi64(a0, a1));
    __m256i b1 = _mm256_add_epi32(_mm256_unpacklo_epi64(a2, a3), _mm256_unpackhi_epi64(a2, a3));
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

/* Block b of 8 rows of W (blk = row 0's block, rows row_bytes apart): the weight bytes (wu: as the
 * unsigned operand), the 8 scales and the 8 min terms; and the next tile's bytes fetched: 8 row
 * streams at once defeat the hardware prefetcher on a W bigger than the caches (the Q8_0 LM head
 * ran 1.5x slower than row by row without it). */
static inline AE_TGT __attribute__((always_inline)) void AE_FN(load8)(const int type, const uint8_t *blk,
                                                                    int64_t row_bytes, const uint8_t *prefetch,
                                                                    int64_t pf_bytes, __m256i wb[8], __m256i wu[8],
                                                                    __m256 *dw, __m256 *m) {
    for (int64_t off = 0; off < pf_bytes; off += 64) _mm_prefetch((const char *)(prefetch + off), _MM_HINT_T0);
    for (int r = 0; r < AE_Q_NR; r++) {
        wb[r] = AE_FN(weight_bytes)(type, blk + r * row_bytes);
        wu[r] = type == AE_Q_Q8_0 ? _mm256_sign_epi8(wb[r], wb[r]) : wb[r];
    }
    AE_FN(fp16x8_pairs)(blk, row_bytes, dw, m);
    if (type == AE_Q_Q4_0) *m = _mm256_mul_ps(*dw, _mm256_set1_ps(-8.0f));
}

/* acc (8 outputs: the 8 rows of W) += this block's dot products with one int8 block of x. */
static inline AE_TGT __attribute__((always_inline)) __m256 AE_FN(dot8)(const int type, const __m256i wb[8],
                                                                     const __m256i wu[8], __m256 dw, __m256 m,
                                                                     const int8_t *xq8, float dx, float sx,
                                                                     __m256 acc) {
    const __m256i xq = _mm256_loadu_si256((const __m256i *)xq8);
    __m256i p[AE_Q_NR];
    for (int r = 0; r < AE_Q_NR; r++) /* u8 x s8: Q8_0 moves w's sign onto x (|w| * sign(w) x) */
        p[r] = AE_FN(dot_u8s8)(wu[r], type == AE_Q_Q8_0 ? _mm256_sign_epi8(xq, wb[r]) : xq);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(AE_FN(reduce8)(p)), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc);
    return type == AE_Q_Q8_0 ? acc : _mm256_fmadd_ps(m, _mm256_set1_ps(sx), acc);
}

/* out rows [m0, m0 + mc) x cols [n, n + 8): 8 rows of W at once, so the per-block float work (int
 * -> float, the two scales, the min term) is one vector op per 8 outputs instead of one per output,
 * and each unpacked weight block serves all mc rows of x. fixed (1-4, a compile-time constant) keeps
 * the accumulators in registers: through memory, a store-to-load round trip per block would chain
 * the blocks of a decode row; 0 = mc rows (<= AE_Q_MC) accumulated in acc. Both run the same
 * operations per row in the same order (batch invariance, above). */
static inline AE_TGT __attribute__((always_inline)) void AE_FN(tile8)(const int type, const int fixed,
                                                                    const uint8_t *w, int64_t row_bytes, int64_t nb,
                                                                    const int8_t *q, int64_t K, const float *d,
                                                                    const float *s, int64_t mc, float *acc) {
    const int bs = block_bytes(type);
    const int64_t pf_step = (AE_Q_NR * row_bytes / nb + 63) / 64 * 64;
    __m256i wb[AE_Q_NR], wu[AE_Q_NR];
    __m256 dw, m;
    if (fixed) {
        __m256 av[4];
        for (int i = 0; i < fixed; i++) av[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            AE_FN(load8)(type, w + b * bs, row_bytes, w + AE_Q_NR * row_bytes + b * pf_step, pf_step, wb, wu, &dw, &m);
            for (int i = 0; i < fixed; i++)
                av[i] = AE_FN(dot8)(type, wb, wu, dw, m, q + i * K + b * 32, d[i * nb + b], s[i * nb + b], av[i]);
        }
        for (int i = 0; i < fixed; i++) _mm256_store_ps(acc + 8 * i, av[i]);
        return;
    }
    for (int64_t i = 0; i < mc; i++) _mm256_store_ps(acc + 8 * i, _mm256_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        AE_FN(load8)(type, w + b * bs, row_bytes, w + AE_Q_NR * row_bytes + b * pf_step, pf_step, wb, wu, &dw, &m);
        for (int64_t i = 0; i < mc; i++)
            _mm256_store_ps(acc + 8 * i, AE_FN(dot8)(type, wb, wu, dw, m, q + i * K + b * 32, d[i * nb + b],
                                                     s[i * nb + b], _mm256_load_ps(acc + 8 * i)));
    }
}
#endif /* AE_LVL >= 1 */

/* res[i] = dot(dequant(W row), int8 x row i) for the mb (<= AE_Q_MB8) rows of a tile: the portable
 * copy's whole kernel, and the SIMD copies' last N % 8 rows of the row layout. The float work is
 * the SIMD tiles' (dot8, x8_acc) written out per row with explicit fmaf: the same bits. */
static inline AE_TGT __attribute__((always_inline)) void AE_FN(row_i8)(const int type, const int x8, const int mb,
                                                                     const ae_qrow *r, int64_t nb, const int8_t *q,
                                                                     int64_t ldq, const float *d, const float *s,
                                                                     float *res) {
    float acc[AE_Q_MB8] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = r->base + b * r->step;
        int wq[32];
        const float dw = fp16_to_fp32(blk + r->d);
        float m = 0.0f;
        uint8_t g[32]; /* x8: the block's quant bytes gathered from their 8-byte chunks */
        const uint8_t *qb = blk + r->q;
        if (x8) {
            for (int c = 0; c < (type == AE_Q_Q8_0 ? 4 : 2); c++) memcpy(g + 8 * c, qb + 64 * c, 8);
            qb = g;
        }
        if (type == AE_Q_Q8_0) {
            for (int j = 0; j < 32; j++) wq[j] = (int8_t)qb[j];
        } else {
            m = type == AE_Q_Q4_1 ? fp16_to_fp32(blk + r->m) : dw * -8.0f;
            for (int j = 0; j < 16; j++) {
                wq[j] = qb[j] & 0x0F;
                wq[j + 16] = qb[j] >> 4;
            }
        }
        for (int i = 0; i < mb; i++) {
            const int8_t *xp = q + i * ldq + b * 32;
            int sum = 0;
            for (int j = 0; j < 32; j++) sum += wq[j] * xp[j];
            acc[i] = fmaf((float)sum, dw * d[i * nb + b], acc[i]);
            if (type != AE_Q_Q8_0) acc[i] = fmaf(m, s[i * nb + b], acc[i]);
        }
    }
    for (int i = 0; i < mb; i++) res[i] = acc[i];
}

/* Rows [n0, n1) of out for every row of x; type and x8 compile-time constants (see gemm_i8). */
static inline AE_TGT __attribute__((always_inline)) void AE_FN(chunk_i8)(
    const int type, const int x8, int64_t n0, const int64_t n1, const int8_t *q, const float *d, const float *s,
    const int32_t *xsum, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias, float *out,
    int64_t ldo, int accumulate) {
    if (is_kquant(type)) { /* d: per 256 values (q8_K); xsum: per 32 */
        AE_FN(chunk_k)(type, n0, n1, q, d, xsum, M, K, w, N, bias, out, ldo, accumulate);
        return;
    }
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(type);
    const uint8_t *wend = w + N * row_bytes;
    (void)xsum, (void)row_bytes, (void)wend;
#if AE_LVL >= 1
    if (x8) /* N % 8 == 0: whole groups */
        for (; n0 + AE_Q_NR <= n1; n0 += AE_Q_NR)
            for (int64_t m0 = 0; m0 < M; m0 += AE_Q_MC) {
                const int64_t mc = M - m0 < AE_Q_MC ? M - m0 : AE_Q_MC;
                float acc[AE_Q_MC * AE_Q_NR] __attribute__((aligned(32)));
                const uint8_t *grp = w + n0 * row_bytes;
                const int8_t *qt = q + m0 * K;
                const float *dt = d + m0 * nb, *st = s + m0 * nb;
                const int32_t *xt = xsum + m0 * nb;
                switch (mc) {
                    case 1: AE_FN(tile_x8)(type, 1, grp, nb, qt, K, dt, st, xt, mc, acc, wend); break;
                    case 2: AE_FN(tile_x8)(type, 2, grp, nb, qt, K, dt, st, xt, mc, acc, wend); break;
                    case 3: AE_FN(tile_x8)(type, 3, grp, nb, qt, K, dt, st, xt, mc, acc, wend); break;
                    case 4: AE_FN(tile_x8)(type, 4, grp, nb, qt, K, dt, st, xt, mc, acc, wend); break;
                    default: AE_FN(tile_x8)(type, 0, grp, nb, qt, K, dt, st, xt, mc, acc, wend); break;
                }
                for (int64_t i = 0; i < mc; i++)
                    for (int r = 0; r < AE_Q_NR; r++) {
                        float *o = out + (m0 + i) * ldo + n0 + r;
                        const float v = acc[i * AE_Q_NR + r] + (bias ? bias[n0 + r] : 0.0f);
                        *o = accumulate ? *o + v : v;
                    }
            }
    for (; !x8 && n0 + AE_Q_NR <= n1; n0 += AE_Q_NR)
        for (int64_t m0 = 0; m0 < M; m0 += AE_Q_MC) {
            const int64_t mc = M - m0 < AE_Q_MC ? M - m0 : AE_Q_MC;
            float acc[AE_Q_MC * AE_Q_NR] __attribute__((aligned(32)));
            const uint8_t *wt = w + n0 * row_bytes;
            const int8_t *qt = q + m0 * K;
            const float *dt = d + m0 * nb, *st = s + m0 * nb;
            switch (mc) {
                case 1: AE_FN(tile8)(type, 1, wt, row_bytes, nb, qt, K, dt, st, mc, acc); break;
                case 2: AE_FN(tile8)(type, 2, wt, row_bytes, nb, qt, K, dt, st, mc, acc); break;
                case 3: AE_FN(tile8)(type, 3, wt, row_bytes, nb, qt, K, dt, st, mc, acc); break;
                case 4: AE_FN(tile8)(type, 4, wt, row_bytes, nb, qt, K, dt, st, mc, acc); break;
                default: AE_FN(tile8)(type, 0, wt, row_bytes, nb, qt, K, dt, st, mc, acc); break;
            }
            for (int64_t i = 0; i < mc; i++)
                for (int r = 0; r < AE_Q_NR; r++) {
                    float *o = out + (m0 + i) * ldo + n0 + r;
                    const float v = acc[i * AE_Q_NR + r] + (bias ? bias[n0 + r] : 0.0f);
                    *o = accumulate ? *o + v : v;
                }
        }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += AE_Q_MB8) { /* the rows left (all of them in portable C) */
        const int64_t mb = M - m0 < AE_Q_MB8 ? M - m0 : AE_Q_MB8;
        const int8_t *qt = q + m0 * K;
        const float *dt = d + m0 * nb, *st = s + m0 * nb;
        for (int64_t n = n0; n < n1; n++) {
            float res[AE_Q_MB8];
            const ae_qrow wr = qrow(type, x8, w, row_bytes, n);
            switch (mb) {
                case 4: AE_FN(row_i8)(type, x8, 4, &wr, nb, qt, K, dt, st, res); break;
                case 3: AE_FN(row_i8)(type, x8, 3, &wr, nb, qt, K, dt, st, res); break;
                case 2: AE_FN(row_i8)(type, x8, 2, &wr, nb, qt, K, dt, st, res); break;
                default: AE_FN(row_i8)(type, x8, 1, &wr, nb, qt, K, dt, st, res); break;
            }
            const float bn = bias ? bias[n] : 0.0f;
            for (int64_t i = 0; i < mb; i++) {
                float *o = out + (m0 + i) * ldo + n;
                *o = accumulate ? *o + res[i] + bn : res[i] + bn;
            }
        }
    }
}

/* Rows [n0, n1) of out on one thread, no OpenMP region (ae_q_rows_q8: a caller that shares the
 * row blocks of several weights out over its own threads); x prepared by ae_q_prepare_act. */
static AE_TGT void AE_FN(rows_i8)(int type, const int8_t *q, const float *d, const float *s, const int32_t *xsum,
                                  int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t n0, int64_t n1,
                                  float *out, int64_t ldo) {
#define AE_Q_CASE(t, f) \
    case t | f: AE_FN(chunk_i8)(t, f != 0, n0, n1, q, d, s, xsum, M, K, w, N, NULL, out, ldo, 0); break;
    switch (type) {
        AE_Q_FOR_EACH_FORMAT(AE_Q_CASE)
    }
#undef AE_Q_CASE
}

/* One entry point per ISA (quant_i8.c's dispatcher calls it); type may carry AE_Q_X8. The switch on
 * the type is inside the parallel loop: GCC outlines an OpenMP region once, before inlining, so a
 * region in a function typed by its caller would run with the type as a run-time value (quant.c:
 * gemm_run). Returns 0, or -1 when out of memory. */
static AE_TGT int AE_FN(gemm_i8)(int type, const int8_t *q, const float *d, const float *s, int64_t M, int64_t K,
                                 const uint8_t *w, int64_t N, const float *bias, float *out, int64_t ldo,
                                 int accumulate, int nthreads) {
    const int64_t nb = K / 32, chunks = (N + AE_Q_CHUNK - 1) / AE_Q_CHUNK;
    int32_t *xsum = NULL; /* per (row of x, 32 values): sum of q, for x8's offset and the K-quants' mins */
    if ((type & AE_Q_X8) || is_kquant(type)) {
        xsum = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * nb > 0 ? M * nb : 1));
        if (!xsum) return -1;
        for (int64_t i = 0; i < M * nb; i++) {
            int32_t t = 0;
            for (int j = 0; j < 32; j++) t += q[i * 32 + j];
            xsum[i] = t;
        }
    }
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && chunks > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * AE_Q_CHUNK, n1 = n0 + AE_Q_CHUNK < N ? n0 + AE_Q_CHUNK : N;
#define AE_Q_CASE(t, f) \
    case t | f: AE_FN(chunk_i8)(t, f != 0, n0, n1, q, d, s, xsum, M, K, w, N, bias, out, ldo, accumulate); break;
        switch (type) {
            AE_Q_FOR_EACH_FORMAT(AE_Q_CASE)
        }
#undef AE_Q_CASE
    }
    free(xsum);
    return 0;
}
