/* The int8-cache attention's item loop (attention_i8_item.h) for each instruction set: portable C,
 * AVX2 + FMA (keys 8 at a time, block sizes % 8, head dims % 8) and AVX-512 (keys 16 at a time,
 * block sizes % 16, head dims % 16). attention_i8.c picks one per call from the ISA level in use
 * (isa.h: what cpuid and the OS grant, or a lower level forced by the tests).
 * Dequantizing is one widening convert and one multiply per value (int8 -> int32 -> fp32, times the
 * row's scale), done once per tile of keys for every query row of the item. */
#include "attention_i8.h"
#include "simd.h"

/* ---- portable C ---- */
static inline void conv_c(float *dst, const int8_t *src, int n, int D) {
    for (int j = 0; j < n; j++) {
        const int8_t *row = src + (long)j * (D + 2);
        const float sc = i8_half_load(row + D);
        for (int d = 0; d < D; d++) dst[(long)j * D + d] = (float)row[d] * sc;
    }
}
static inline void dots_c(float *s, const float *q, const float *kf, int n, int D) {
    for (int j = 0; j < n; j++) {
        float dot = 0.0f;
        for (int d = 0; d < D; d++) dot += q[d] * kf[(long)j * D + d];
        s[j] = dot;
    }
}
static inline float expsum_c(float *s, int j0, int j1, float m) {
    float sum = 0.0f;
    for (int j = j0; j < j1; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}
static inline void pv_c(float *acc, float corr, const float *p, const float *vf, int j0, int j1, int D) {
    for (int d = 0; d < D; d++) {
        float a = acc[d] * corr;
        for (int j = j0; j < j1; j++) a += p[j] * vf[(long)j * D + d];
        acc[d] = a;
    }
}
#define I8_FN i8_rows_scalar_impl
#define I8_TGT
#define I8_CONV conv_c
#define I8_DOTS dots_c
#define I8_EXPSUM expsum_c
#define I8_PV pv_c
#include "attention_i8_item.h"
#undef I8_FN
#undef I8_TGT
#undef I8_CONV
#undef I8_DOTS
#undef I8_EXPSUM
#undef I8_PV

#if AE_X86
/* ---- AVX2 + FMA ---- */
#define T2 AE_TGT_AVX2
static inline T2 void conv_2(float *dst, const int8_t *src, int n, int D) {
    for (int j = 0; j < n; j++) {
        const int8_t *row = src + (long)j * (D + 2);
        const __m256 sc = _mm256_set1_ps(i8_half_load(row + D));
        for (int d = 0; d < D; d += 8) {
            __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + d)));
            _mm256_storeu_ps(dst + (long)j * D + d, _mm256_mul_ps(_mm256_cvtepi32_ps(w), sc));
        }
    }
}
static inline T2 void dots_2(float *s, const float *q, const float *kf, int n, int D) {
    for (int j0 = 0; j0 < n; j0 += 8) {
        __m256 a[8];
        for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            __m256 qv = _mm256_loadu_ps(q + d);
            for (int k = 0; k < 8; k++) a[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf + (long)(j0 + k) * D + d), a[k]);
        }
        __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        _mm256_storeu_ps(s + j0, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                               _mm256_permute2f128_ps(u0, u1, 0x31)));
    }
}
static inline T2 float expsum_2(float *s, int j0, int j1, float m) {
    __m256 mv = _mm256_set1_ps(m), sumv = _mm256_setzero_ps();
    int j = j0;
    for (; j + 8 <= j1; j += 8) {
        __m256 p = ae_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, p);
        sumv = _mm256_add_ps(sumv, p);
    }
    float sum = ae_hsum8(sumv);
    for (; j < j1; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}
static inline T2 void pv_2(float *acc, float corr, const float *p, const float *vf, int j0, int j1, int D) {
    const __m256 cv = _mm256_set1_ps(corr);
    int d = 0;
    for (; d + 32 <= D; d += 32) { /* four independent FMA chains */
        __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + d), cv), a1 = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8), cv);
        __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 16), cv), a3 = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 24), cv);
        for (int j = j0; j < j1; j++) {
            const float *v = vf + (long)j * D + d;
            const __m256 pj = _mm256_set1_ps(p[j]);
            a0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(acc + d, a0), _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2), _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d < D; d += 8) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + d), cv);
        for (int j = j0; j < j1; j++) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(vf + (long)j * D + d), a);
        _mm256_storeu_ps(acc + d, a);
    }
}
#define I8_FN i8_rows_avx2_impl
#define I8_TGT T2
#define I8_CONV conv_2
#define I8_DOTS dots_2
#define I8_EXPSUM expsum_2
#define I8_PV pv_2
#include "attention_i8_item.h"
#undef I8_FN
#undef I8_TGT
#undef I8_CONV
#undef I8_DOTS
#undef I8_EXPSUM
#undef I8_PV

/* ---- AVX-512 ---- */
#define T5 AE_TGT_AVX512
static inline T5 void conv_5(float *dst, const int8_t *src, int n, int D) {
    for (int j = 0; j < n; j++) {
        const int8_t *row = src + (long)j * (D + 2);
        const __m512 sc = _mm512_set1_ps(i8_half_load(row + D));
        for (int d = 0; d < D; d += 16) {
            __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d)));
            _mm512_storeu_ps(dst + (long)j * D + d, _mm512_mul_ps(_mm512_cvtepi32_ps(w), sc));
        }
    }
}
/* 16 vectors of per-key partial sums -> the 16 keys' sums, in key order */
static inline T5 __m512 reduce16_5(__m512 a[16]) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}
static inline T5 void dots_5(float *s, const float *q, const float *kf, int n, int D) {
    (void)n; /* always 16 keys on this path */
    __m512 a[16];
    for (int k = 0; k < 16; k++) a[k] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        __m512 qv = _mm512_loadu_ps(q + d);
        for (int k = 0; k < 16; k++) a[k] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kf + (long)k * D + d), a[k]);
    }
    _mm512_storeu_ps(s, reduce16_5(a));
}
static inline T5 float expsum_5(float *s, int j0, int j1, float m) {
    const __mmask16 k = (__mmask16)(((1u << (j1 - j0)) - 1u) << j0);
    __m512 p = ae_exp16(_mm512_sub_ps(_mm512_loadu_ps(s), _mm512_set1_ps(m)));
    p = _mm512_maskz_mov_ps(k, p);
    _mm512_storeu_ps(s, p);
    return _mm512_reduce_add_ps(p);
}
static inline T5 void pv_5(float *acc, float corr, const float *p, const float *vf, int j0, int j1, int D) {
    const __m512 cv = _mm512_set1_ps(corr);
    int d = 0;
    for (; d + 64 <= D; d += 64) { /* four independent FMA chains */
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + d), cv), a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 16), cv);
        __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 32), cv), a3 = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 48), cv);
        for (int j = j0; j < j1; j++) {
            const float *v = vf + (long)j * D + d;
            const __m512 pj = _mm512_set1_ps(p[j]);
            a0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v), a0);
            a1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + 16), a1);
            a2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + 32), a2);
            a3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + 48), a3);
        }
        _mm512_storeu_ps(acc + d, a0), _mm512_storeu_ps(acc + d + 16, a1);
        _mm512_storeu_ps(acc + d + 32, a2), _mm512_storeu_ps(acc + d + 48, a3);
    }
    for (; d < D; d += 16) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + d), cv);
        for (int j = j0; j < j1; j++) a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(vf + (long)j * D + d), a);
        _mm512_storeu_ps(acc + d, a);
    }
}
#define I8_FN i8_rows_avx512_impl
#define I8_TGT T5
#define I8_CONV conv_5
#define I8_DOTS dots_5
#define I8_EXPSUM expsum_5
#define I8_PV pv_5
#include "attention_i8_item.h"

void i8_rows_scalar(const struct i8_args *A) { i8_rows_scalar_impl(A); }
void i8_rows_avx2(const struct i8_args *A) { i8_rows_avx2_impl(A); }
void i8_rows_avx512(const struct i8_args *A) { i8_rows_avx512_impl(A); }
#else
void i8_rows_scalar(const struct i8_args *A) { i8_rows_scalar_impl(A); }
void i8_rows_avx2(const struct i8_args *A) { i8_rows_scalar(A); }
void i8_rows_avx512(const struct i8_args *A) { i8_rows_scalar(A); }
#endif
