/* One work item of the int8-cache attention, stamped out once per ISA (attention_i8_isa.c includes
 * it with I8_FN, I8_TGT and the four helpers below defined for that ISA):
 *   I8_CONV(dst, src, n, D)        n rows of int8 + half scale -> fp32 (value * scale), into L1
 *   I8_DOTS(s, q, kf, n, D)        s[j] = q . kf[j], j < n
 *   I8_EXPSUM(s, j0, j1, m)        s[j] = exp(s[j] - m) over [j0, j1), returns their sum
 *   I8_PV(acc, corr, s, vf, j0, j1, D)  acc = acc * corr + sum_j s[j] vf[j]
 * Keys go AE_I8_TILE at a time: the tile's keys and values are dequantized once (16 rows, not a copy
 * of the cache) and every query row of the item (the GQA group, a few query tokens) reads them while
 * they sit in L1; online softmax in fp32 as attention.c. A row's result depends on its own keys
 * only, in position order. */

static I8_TGT void I8_FN(const struct i8_args *A) {
    const int D = A->D, bs = A->bs, nr = A->nr, RS = D + 2;
    const int TK = bs < AE_I8_TILE ? bs : AE_I8_TILE;
    float m[AE_ATTN_ROW_TILE], l[AE_ATTN_ROW_TILE];
    float kf[AE_I8_TILE * AE_ATTN_MAX_D], vf[AE_I8_TILE * AE_ATTN_MAX_D];
    float s[AE_I8_TILE];
    int pmin = 1 << 30, pmax = -1;
    for (int r = 0; r < nr; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(A->acc + (long)r * D, 0, sizeof(float) * D);
        pmin = A->qpos[r] < pmin ? A->qpos[r] : pmin;
        pmax = A->qpos[r] > pmax ? A->qpos[r] : pmax;
    }
    int lo_all = A->window > 0 ? pmin - A->window + 1 : 0;
    if (lo_all < 0) lo_all = 0;
    for (int t0 = lo_all / TK * TK; t0 <= pmax; t0 += TK) {
        const long row0 = (long)A->table[t0 / bs] * bs + t0 % bs;
        I8_CONV(kf, A->kc + row0 * RS, TK, D);
        I8_CONV(vf, A->vc + row0 * RS, TK, D);
        for (int r = 0; r < nr; r++) {
            int hi = A->qpos[r], lo = A->window > 0 ? hi - A->window + 1 : 0;
            int j0 = lo - t0, j1 = hi - t0 + 1;
            if (j0 < 0) j0 = 0;
            if (j1 > TK) j1 = TK;
            if (j0 >= j1) continue;
            I8_DOTS(s, A->qf + (long)r * D, kf, TK, D);
            if (A->softcap > 0.0f)
                for (int j = j0; j < j1; j++) s[j] = attn_softcap1(s[j], A->softcap);
            float mx = -INFINITY;
            for (int j = j0; j < j1; j++) mx = s[j] > mx ? s[j] : mx;
            const float mnew = mx > m[r] ? mx : m[r];
            const float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - mnew);
            const float sum = I8_EXPSUM(s, j0, j1, mnew);
            l[r] = l[r] * corr + sum;
            m[r] = mnew;
            I8_PV(A->acc + (long)r * D, corr, s, vf, j0, j1, D);
        }
    }
    for (int r = 0; r < nr; r++) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int d = 0; d < D; d++) A->acc[(long)r * D + d] *= inv;
    }
}
