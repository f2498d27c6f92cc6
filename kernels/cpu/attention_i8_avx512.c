/* The int8-cache attention's item loop with AVX-512 VNNI, for head dims % 64 and block sizes % 16
 * (the default model's 64 and 16): what makes an 8-bit cache faster to decode than a 16-bit one,
 * not only smaller. (attention_i8_isa.c's loops dequantize each tile to fp32 first: bound by the
 * converts, they ran a 1 x 8k-key decode slower than the bf16 cache's loop.)
 *   QK: each query row is itself rounded to int8 (one scale per row, as llama.cpp rounds Q to the
 *       K cache's q8_0 type for its dot products), and 16 keys' dot products are one vpdpbusd
 *       per 64 dims each (keys biased to unsigned by xor 0x80, the bias taken out with the row's
 *       sum), then scaled by the row's and each key's scale.
 *   PV: each value row is widened once per group of up to 4 query rows and accumulated with the
 *       softmax weight times the row's scale; weights of keys outside a row's range are 0.
 * Online softmax in fp32 over tiles of 16 keys. A row's result depends on its own keys only. */
#include "attention_i8.h"
#include "simd.h"

#if AE_X86

#define TV __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

/* 16 vectors of per-key int32 partial sums -> the 16 keys' sums, in key order. */
static inline TV __m512i reduce16_i32(__m512i a[16]) {
    __m512i b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_epi64(b[2 * i], b[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        e[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2 * i], c[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(e[0], e[1], 0x88), _mm512_shuffle_i32x4(e[0], e[1], 0xDD));
}

/* The 16 half scales of the rows at p (rows RS bytes apart) as fp32. */
static inline TV __m512 scales16(const int8_t *p, int D, int RS) {
    uint16_t h[16];
    for (int j = 0; j < 16; j++) memcpy(h + j, p + (long)j * RS + D, 2);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
}

/* acc[r] = acc[r] * corr[r] + sum_j w[r][j] v_j over the 16 rows at vp, rows [r0, r0 + NR). */
static inline TV __attribute__((always_inline)) void pv_group(float *acc, const float *corr, const float *w,
                                                               const int8_t *vp, int D, int RS, int r0, int NR) {
    for (int d = 0; d < D; d += 64) {
        __m512 a[4][4];
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < 4; t++)
                a[r][t] = _mm512_mul_ps(_mm512_loadu_ps(acc + (long)(r0 + r) * D + d + 16 * t),
                                        _mm512_set1_ps(corr[r0 + r]));
        for (int j = 0; j < 16; j++) {
            const int8_t *v = vp + (long)j * RS + d;
            __m512 vf[4];
            for (int t = 0; t < 4; t++)
                vf[t] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v + 16 * t))));
            for (int r = 0; r < NR; r++) {
                const __m512 wj = _mm512_set1_ps(w[(r0 + r) * 16 + j]);
                for (int t = 0; t < 4; t++) a[r][t] = _mm512_fmadd_ps(wj, vf[t], a[r][t]);
            }
        }
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < 4; t++) _mm512_storeu_ps(acc + (long)(r0 + r) * D + d + 16 * t, a[r][t]);
    }
}

static TV void rows_vnni(const struct i8_args *A) {
    const int D = A->D, bs = A->bs, nr = A->nr, RS = D + 2;
    int8_t q8[AE_ATTN_ROW_TILE * AE_ATTN_MAX_D];
    uint8_t kx[16 * AE_ATTN_MAX_D];
    float qscale[AE_ATTN_ROW_TILE], qbias[AE_ATTN_ROW_TILE], m[AE_ATTN_ROW_TILE], l[AE_ATTN_ROW_TILE];
    float corr[AE_ATTN_ROW_TILE], w[AE_ATTN_ROW_TILE * 16];
    int pmin = 1 << 30, pmax = -1;
    for (int r = 0; r < nr; r++) { /* each query row to int8: q ~ q8 * qscale */
        const float *q = A->qf + (long)r * D;
        float amax = 0.0f;
        for (int d = 0; d < D; d++) amax = fabsf(q[d]) > amax ? fabsf(q[d]) : amax;
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int d = 0; d < D; d++) {
            const int v = (int)nearbyintf(q[d] * id);
            q8[(long)r * D + d] = (int8_t)v;
            sum += v;
        }
        qscale[r] = amax / 127.0f;
        qbias[r] = 128.0f * (float)sum; /* (k + 128) . q = k . q + 128 sum(q) */
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(A->acc + (long)r * D, 0, sizeof(float) * D);
        pmin = A->qpos[r] < pmin ? A->qpos[r] : pmin;
        pmax = A->qpos[r] > pmax ? A->qpos[r] : pmax;
    }
    int lo_all = A->window > 0 ? pmin - A->window + 1 : 0;
    if (lo_all < 0) lo_all = 0;
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int t0 = lo_all / 16 * 16; t0 <= pmax; t0 += 16) {
        const long row0 = (long)A->table[t0 / bs] * bs + t0 % bs;
        const int8_t *kp = A->kc + row0 * RS, *vp = A->vc + row0 * RS;
        for (int j = 0; j < 16; j++)
            for (int d = 0; d < D; d += 64)
                _mm512_storeu_si512(kx + j * D + d, _mm512_xor_si512(_mm512_loadu_si512(kp + (long)j * RS + d), bias));
        const __m512 ks = scales16(kp, D, RS), vs = scales16(vp, D, RS);
        for (int r = 0; r < nr; r++) {
            int hi = A->qpos[r], lo = A->window > 0 ? hi - A->window + 1 : 0;
            int j0 = lo - t0, j1 = hi - t0 + 1;
            j0 = j0 < 0 ? 0 : j0;
            j1 = j1 > 16 ? 16 : j1;
            if (j0 >= j1) { /* no key of this tile for this row */
                corr[r] = 1.0f;
                memset(w + r * 16, 0, sizeof(float) * 16);
                continue;
            }
            __m512i a[16];
            for (int k = 0; k < 16; k++) a[k] = _mm512_setzero_si512();
            for (int d = 0; d < D; d += 64) {
                const __m512i qv = _mm512_loadu_si512(q8 + (long)r * D + d);
                for (int k = 0; k < 16; k++) a[k] = _mm512_dpbusd_epi32(a[k], _mm512_loadu_si512(kx + k * D + d), qv);
            }
            __m512 s = _mm512_sub_ps(_mm512_cvtepi32_ps(reduce16_i32(a)), _mm512_set1_ps(qbias[r]));
            s = _mm512_mul_ps(_mm512_mul_ps(s, _mm512_set1_ps(qscale[r])), ks);
            if (A->softcap > 0.0f) {
                float sv[16];
                _mm512_storeu_ps(sv, s);
                for (int j = 0; j < 16; j++) sv[j] = attn_softcap1(sv[j], A->softcap);
                s = _mm512_loadu_ps(sv);
            }
            const __mmask16 in = (__mmask16)(((1u << (j1 - j0)) - 1u) << j0);
            const float mx = _mm512_mask_reduce_max_ps(in, s);
            const float mnew = mx > m[r] ? mx : m[r];
            corr[r] = m[r] == -INFINITY ? 0.0f : expf(m[r] - mnew);
            const __m512 p = _mm512_maskz_mov_ps(in, ae_exp16(_mm512_sub_ps(s, _mm512_set1_ps(mnew))));
            l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(p);
            m[r] = mnew;
            _mm512_storeu_ps(w + r * 16, _mm512_mul_ps(p, vs));
        }
        int r0 = 0;
        for (; r0 + 4 <= nr; r0 += 4) pv_group(A->acc, corr, w, vp, D, RS, r0, 4);
        if (nr - r0 == 3) pv_group(A->acc, corr, w, vp, D, RS, r0, 3);
        else if (nr - r0 == 2) pv_group(A->acc, corr, w, vp, D, RS, r0, 2);
        else if (nr - r0 == 1) pv_group(A->acc, corr, w, vp, D, RS, r0, 1);
    }
    for (int r = 0; r < nr; r++) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int d = 0; d < D; d++) A->acc[(long)r * D + d] *= inv;
    }
}

void i8_rows_vnni(const struct i8_args *A) { rows_vnni(A); }
#else
void i8_rows_vnni(const struct i8_args *A) { i8_rows_scalar(A); }
#endif
