/* attention_avx512.c's item loop, included once per QK kind: RA_FN its name, RA_TGT its target,
 * RA_DP 1 for vdpbf16ps scores (bf16 caches, AVX512-BF16), 0 for fp32 FMAs.
 *
 * Keys go in chunks of AE_ATTN_CHUNK logical positions (whole blocks: several blocks of 16 or 32,
 * one larger block), not one block at a time: the online softmax's bookkeeping (row maxima, the
 * rescale of the accumulators, their load and store) is paid once per chunk. Measured (one thread,
 * bf16, 128 sequences x 400 keys, blocks shuffled): blocks of 16 took 1.6x the time of blocks of 64
 * when the bookkeeping came every block; in chunks of 64 keys the block size no longer matters.
 * Chunks start at multiples of the chunk size, so a row's result is the same for blocks of 16, 32
 * and 64, and whatever rows or splits share its tile. */
static inline RA_TGT __attribute__((always_inline)) void RA_FN(const struct attn_rows_args *A, int D, int bf16) {
    const int nr = A->nr, bs = A->bs;
    const int chunk = bs < AE_ATTN_CHUNK ? (AE_ATTN_CHUNK / bs) * bs : bs;
    float m[AE_ATTN_ROW_TILE], l[AE_ATTN_ROW_TILE], corr[AE_ATTN_ROW_TILE];
    int lo[AE_ATTN_ROW_TILE], hi[AE_ATTN_ROW_TILE];
    float p[AE_ATTN_ROW_TILE * AE_ATTN_MAX_BS];
    const char *kg[AE_ATTN_MAX_BS / 16], *vg[AE_ATTN_MAX_BS / 16]; /* a chunk's 16-key groups */
    int pmin = 1 << 30, pmax = -1;
    for (int r = 0; r < nr; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(A->acc + (long)r * D, 0, sizeof(float) * D);
        hi[r] = A->qpos[r] < A->khi - 1 ? A->qpos[r] : A->khi - 1;
        lo[r] = A->window > 0 ? A->qpos[r] - A->window + 1 : 0;
        if (lo[r] < A->klo) lo[r] = A->klo;
        if (lo[r] < pmin) pmin = lo[r];
        if (hi[r] > pmax) pmax = hi[r];
    }
    const int elem = bf16 ? 2 : 4;
    const int bfirst = pmin / bs, blast = pmax / bs;
    /* into L2: the item's first AE_ATTN_PREFETCH blocks at once, then one block that far ahead */
    for (int pb = bfirst; pb < bfirst + AE_ATTN_PREFETCH && pb <= blast && pmin <= pmax; pb++)
        prefetch_block(A, pb, bs, D, elem);
    for (int ch = pmin / chunk; ch <= pmax / chunk && pmin <= pmax; ch++) {
        const int kstart = ch * chunk;
        for (int b = kstart / bs > bfirst ? kstart / bs : bfirst; b < (kstart + chunk) / bs && b <= blast; b++) {
            if (b > bfirst && b + AE_ATTN_PREFETCH - 1 <= blast) prefetch_block(A, b + AE_ATTN_PREFETCH - 1, bs, D, elem);
            const long base = (A->head_off + (long)A->table[b] * bs * D) * elem;
            for (int t = 0; t < bs; t += 16) {
                const int g = (b * bs + t - kstart) >> 4;
                kg[g] = (const char *)A->kc + base + (long)t * D * elem;
                vg[g] = (const char *)A->vc + base + (long)t * D * elem;
            }
        }
        int umin = chunk, umax = 0;
        for (int r = 0; r < nr; r++) {
            float *pr = p + r * AE_ATTN_MAX_BS;
            int j0 = lo[r] - kstart, j1 = hi[r] - kstart + 1;
            j0 = j0 < 0 ? 0 : j0;
            j1 = j1 > chunk ? chunk : j1;
            corr[r] = 1.0f;
            if (j0 >= j1) {
                memset(pr, 0, sizeof(float) * chunk);
                continue;
            }
            umin = j0 < umin ? j0 : umin;
            umax = j1 > umax ? j1 : umax;
            const int c0 = j0 & ~15;
            __m512 mxv = _mm512_set1_ps(-INFINITY);
            for (int c = c0; c < j1; c += 16) {
#if RA_DP
                __m512 s = qk16_dp(A->qb + (long)r * D, (const uint16_t *)kg[c >> 4], D, A->scale);
#else
                __m512 s = qk16_f32(A->qf + (long)r * D, kg[c >> 4], D, bf16);
#endif
                if (A->softcap > 0.0f) s = ae_softcap16(s, A->softcap); /* Gemma 2: same bits as the C loop */
                int a = j0 > c ? j0 - c : 0, e = j1 - c < 16 ? j1 - c : 16;
                __mmask16 mk = (__mmask16)(((1u << e) - 1u) & ~((1u << a) - 1u));
                s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mk, s);
                mxv = _mm512_max_ps(mxv, s);
                _mm512_storeu_ps(pr + c, s);
            }
            float mx = _mm512_reduce_max_ps(mxv);
            float mnew = mx > m[r] ? mx : m[r];
            corr[r] = m[r] == -INFINITY ? 0.0f : expf(m[r] - mnew);
            __m512 mv = _mm512_set1_ps(mnew), sum = _mm512_setzero_ps();
            for (int c = c0; c < j1; c += 16) {
                int a = j0 > c ? j0 - c : 0, e = j1 - c < 16 ? j1 - c : 16;
                __mmask16 mk = (__mmask16)(((1u << e) - 1u) & ~((1u << a) - 1u));
                __m512 e16 = _mm512_maskz_mov_ps(mk, ae_exp16(_mm512_sub_ps(_mm512_loadu_ps(pr + c), mv)));
                _mm512_storeu_ps(pr + c, e16);
                sum = _mm512_add_ps(sum, e16);
            }
            for (int j = 0; j < c0; j++) pr[j] = 0.0f; /* the union range below may start before j0 */
            for (int j = (j1 + 15) & ~15; j < chunk; j++) pr[j] = 0.0f;
            l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(sum);
            m[r] = mnew;
        }
        if (umin >= umax) continue;
        int r = 0;
        for (; r + 4 <= nr; r += 4)
            pv_rows(A->acc + (long)r * D, corr + r, p + r * AE_ATTN_MAX_BS, vg, umin, umax, D, bf16, 4);
        switch (nr - r) {
            case 3: pv_rows(A->acc + (long)r * D, corr + r, p + r * AE_ATTN_MAX_BS, vg, umin, umax, D, bf16, 3); break;
            case 2: pv_rows(A->acc + (long)r * D, corr + r, p + r * AE_ATTN_MAX_BS, vg, umin, umax, D, bf16, 2); break;
            case 1: pv_rows(A->acc + (long)r * D, corr + r, p + r * AE_ATTN_MAX_BS, vg, umin, umax, D, bf16, 1); break;
            default: break;
        }
    }
    attn_rows_finish(A, m, l, D);
}
