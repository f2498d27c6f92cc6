/* attention_avx512.c's item loop, included once per QK kind: RA_FN its name, RA_TGT its target,
 * RA_DP 1 for vdpbf16ps scores (bf16 caches, AVX512-BF16), 0 for fp32 FMAs. */
static inline RA_TGT __attribute__((always_inline)) void RA_FN(const struct attn_rows_args *A, int D, int bf16) {
    const int nr = A->nr, bs = A->bs;
    float m[AE_ATTN_ROW_TILE], l[AE_ATTN_ROW_TILE], corr[AE_ATTN_ROW_TILE];
    int lo[AE_ATTN_ROW_TILE], hi[AE_ATTN_ROW_TILE];
    float p[AE_ATTN_ROW_TILE * AE_ATTN_MAX_BS];
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
    for (int b = pmin / bs; b <= pmax / bs && pmin <= pmax; b++) {
        const char *kb = (const char *)A->kc + (A->head_off + (long)A->table[b] * bs * D) * elem;
        const char *vb = (const char *)A->vc + (A->head_off + (long)A->table[b] * bs * D) * elem;
        /* into L2: the item's first AE_ATTN_PREFETCH blocks at once, then one block that far ahead */
        const int blast = pmax / bs;
        if (b == pmin / bs)
            for (int pb = b; pb < b + AE_ATTN_PREFETCH && pb <= blast; pb++) prefetch_block(A, pb, bs, D, elem);
        else if (b + AE_ATTN_PREFETCH - 1 <= blast)
            prefetch_block(A, b + AE_ATTN_PREFETCH - 1, bs, D, elem);
        const int kstart = b * bs;
        int umin = bs, umax = 0;
        for (int r = 0; r < nr; r++) {
            float *pr = p + r * AE_ATTN_MAX_BS;
            int j0 = lo[r] - kstart, j1 = hi[r] - kstart + 1;
            j0 = j0 < 0 ? 0 : j0;
            j1 = j1 > bs ? bs : j1;
            corr[r] = 1.0f;
            if (j0 >= j1) {
                memset(pr, 0, sizeof(float) * bs);
                continue;
            }
            umin = j0 < umin ? j0 : umin;
            umax = j1 > umax ? j1 : umax;
            const int c0 = j0 & ~15;
            __m512 mxv = _mm512_set1_ps(-INFINITY);
            for (int c = c0; c < j1; c += 16) {
#if RA_DP
                __m512 s = qk16_dp(A->qb + (long)r * D, (const uint16_t *)kb, c, D, A->scale);
#else
                __m512 s = qk16_f32(A->qf + (long)r * D, kb, c, D, bf16);
#endif
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
            for (int j = (j1 + 15) & ~15; j < bs; j++) pr[j] = 0.0f;
            l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(sum);
            m[r] = mnew;
        }
        if (umin >= umax) continue;
        int r = 0;
        for (; r + 4 <= nr; r += 4)
            pv_rows(A->acc + (long)r * D, corr + r, p + r * AE_ATTN_MAX_BS, vb, umin, umax, D, bf16, 4);
        switch (nr - r) {
            case 3: pv_rows(A->acc + (long)r * D, corr + r, p + r * AE_ATTN_MAX_BS, vb, umin, umax, D, bf16, 3); break;
            case 2: pv_rows(A->acc + (long)r * D, corr + r, p + r * AE_ATTN_MAX_BS, vb, umin, umax, D, bf16, 2); break;
            case 1: pv_rows(A->acc + (long)r * D, corr + r, p + r * AE_ATTN_MAX_BS, vb, umin, umax, D, bf16, 1); break;
            default: break;
        }
    }
    attn_rows_finish(A, m, l, D);
}

