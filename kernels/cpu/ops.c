/* The small per-layer ops of a decoder, fused: RMSNorm (with the residual add), rotary embedding in
 * place, SiLU-and-mul. Each replaces a handful of torch ops (and their dispatch, ~5-10 us apiece at
 * decode sizes) with one call, and reproduces the torch code's rounding steps: fp32 math, results
 * rounded to the tensors' dtype (float32 or bfloat16) where torch rounds them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* The vector rows (ops_vec.h), once per ISA; ops_isa() says which run (isa.h: ASYNCENGINE_CPU_ISA
 * forces a lower one, so the tests run each). */
#define OV_SET1(v) OV_CAT(set1)(v)
#if AE_X86
#define OV_FN(name) name##_avx2
#define OV_TGT AE_TGT_AVX2
#define OV_L 8
#define OV_V __m256
#define OV_LDF _mm256_loadu_ps
#define OV_STF _mm256_storeu_ps
#define OV_LDB ae_ld_bf16x8
#define OV_STB ae_st_bf16x8
#define OV_RNDB ae_round_bf16x8
#define OV_CAT(op) _mm256_##op##_ps
#define OV_ADD _mm256_add_ps
#define OV_SUB _mm256_sub_ps
#define OV_MUL _mm256_mul_ps
#define OV_DIV _mm256_div_ps
#define OV_FMA _mm256_fmadd_ps
#define OV_EXP ae_exp8
#define OV_HSUM ae_hsum8
#include "ops_vec.h"
#undef OV_FN
#undef OV_TGT
#undef OV_L
#undef OV_V
#undef OV_LDF
#undef OV_STF
#undef OV_LDB
#undef OV_STB
#undef OV_RNDB
#undef OV_CAT
#undef OV_ADD
#undef OV_SUB
#undef OV_MUL
#undef OV_DIV
#undef OV_FMA
#undef OV_EXP
#undef OV_HSUM
#define OV_FN(name) name##_avx512
#define OV_TGT AE_TGT_AVX512
#define OV_L 16
#define OV_V __m512
#define OV_LDF _mm512_loadu_ps
#define OV_STF _mm512_storeu_ps
#define OV_LDB ae_ld_bf16x16
#define OV_STB ae_st_bf16x16
#define OV_RNDB ae_round_bf16x16
#define OV_CAT(op) _mm512_##op##_ps
#define OV_ADD _mm512_add_ps
#define OV_SUB _mm512_sub_ps
#define OV_MUL _mm512_mul_ps
#define OV_DIV _mm512_div_ps
#define OV_FMA _mm512_fmadd_ps
#define OV_EXP ae_exp16
#define OV_HSUM ae_hsum16
#include "ops_vec.h"
#endif

/* 0 scalar, 1 the 8-lane rows, 2 the 16-lane rows (AVX512-BF16 adds nothing these ops use). */
static inline int ops_isa(void) {
    int isa = ae_isa();
    return isa >= AE_ISA_AVX512 ? 2 : isa;
}

#if AE_X86
#define OPS_VEC(isa, name, ...) ((isa) == 2 ? name##_avx512(__VA_ARGS__) : (isa) == 1 ? name##_avx2(__VA_ARGS__) : 0)
#else
#define OPS_VEC(isa, name, ...) 0
#endif

#if defined(__GNUC__) && !defined(__clang__)
#define OPS_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define OPS_NO_CONTRACT
#endif

static inline float ops_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t ops_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float ops_ld(const void *p, long i, int bf16) {
    return bf16 ? ops_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void ops_st(void *p, long i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = ops_f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* The value as the tensor's dtype holds it (the rounding torch does at each op's output). */
static inline float ops_round(float v, int bf16) { return bf16 ? ops_bf16_to_f32(ops_f32_to_bf16(v)) : v; }

/* One row: out = w * dtype(x * rsqrt(mean(x^2) + eps)). */
static inline void ops_norm_row(const void *x, long xo, void *out, long oo, const void *w, int dim, float eps,
                                int bf16, int isa) {
    float ss = 0.0f;
    int d = 0;
#if AE_X86
    if (isa == 2) ss = ov_sumsq_avx512(x, xo, dim, bf16, &d);
    else if (isa == 1) ss = ov_sumsq_avx2(x, xo, dim, bf16, &d);
#endif
    for (; d < dim; d++) {
        float v = ops_ld(x, xo + d, bf16);
        ss += v * v;
    }
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
    d = OPS_VEC(isa, ov_scale_row, x, xo, out, oo, w, dim, r, bf16);
    for (; d < dim; d++) ops_st(out, oo + d, ops_ld(w, d, bf16) * ops_round(ops_ld(x, xo + d, bf16) * r, bf16), bf16);
}

/* RMSNorm over the last dim of x viewed as [n_outer, n_inner, dim] with strides (outer, inner)
 * in elements; out is contiguous [n_outer * n_inner, dim]. */
void ae_ops_rms_norm(const void *x, long outer_stride, long inner_stride, int n_outer, int n_inner, void *out,
                     const void *w, int dim, float eps, int bf16, int parallel) {
    long rows = (long)n_outer * n_inner;
    const int isa = ops_isa();
#pragma omp parallel for if (parallel) schedule(static)
    for (long r = 0; r < rows; r++) {
        long xo = (r / n_inner) * outer_stride + (r % n_inner) * inner_stride;
        ops_norm_row(x, xo, out, r * dim, w, dim, eps, bf16, isa);
    }
}

/* s = x + residual (rounded to the dtype), out = RMSNorm(s); x, residual, sum_out and out are
 * contiguous [rows, dim]. */
void ae_ops_add_rms_norm(const void *x, const void *residual, void *sum_out, void *out, const void *w, int rows,
                         int dim, float eps, int bf16, int parallel) {
    const int isa = ops_isa();
#pragma omp parallel for if (parallel) schedule(static)
    for (long r = 0; r < rows; r++) {
        long o = r * dim;
        int d = OPS_VEC(isa, ov_add_row, x, residual, sum_out, o, dim, bf16);
        for (; d < dim; d++) ops_st(sum_out, o + d, ops_ld(x, o + d, bf16) + ops_ld(residual, o + d, bf16), bf16);
        ops_norm_row(sum_out, o, out, o, w, dim, eps, bf16, isa);
    }
}

/* Rotary ("rotate half" form): out = x * cos + swap_halves(x) * sin_signed, each product and the
 * sum rounded to the dtype as torch computes them. x, out: [T, H, D], rows (tokens) x_stride /
 * out_stride elements apart, heads contiguous (out may be x: in place); cos, sin_signed: [T, D]
 * contiguous (this step's rows). */
OPS_NO_CONTRACT
void ae_ops_rotary(const void *x, long x_stride, void *out, long out_stride, int T, int H, int D, const void *cos,
                   const void *sin_signed, int bf16, int parallel) {
    int half = D / 2;
    int isa = ops_isa();
    if (isa == 2 && half % 16) isa = 1;
    if (isa == 1 && half % 8) isa = 0;
#pragma omp parallel for if (parallel) schedule(static)
    for (long th = 0; th < (long)T * H; th++) {
        long t = th / H, h = th % H;
        long o = t * x_stride + h * D, oo = t * out_stride + h * D;
        const long c = t * D;
#if AE_X86
        if (isa) {
            float tmp[1024]; /* D <= 1024 (ops.py); in place: read the whole head before writing */
            if (isa == 2) ov_rotary_row_avx512(x, o, tmp, 0, cos, sin_signed, c, D, bf16);
            else ov_rotary_row_avx2(x, o, tmp, 0, cos, sin_signed, c, D, bf16);
            memcpy((char *)out + oo * (bf16 ? 2 : 4), tmp, (size_t)D * (bf16 ? 2 : 4));
            continue;
        }
#endif
        if (!bf16) {
            const float *v = (const float *)x + o;
            const float *cf = (const float *)cos + c, *sf = (const float *)sin_signed + c;
            float tmp[1024];
            for (int d = 0; d < D; d++) {
                float a = v[d] * cf[d];
                float b = v[d < half ? d + half : d - half] * sf[d];
                tmp[d] = a + b;
            }
            memcpy((float *)out + oo, tmp, sizeof(float) * D);
        } else {
            uint16_t tmp[1024];
            for (int d = 0; d < D; d++) {
                float a = ops_round(ops_ld(x, o + d, 1) * ops_ld(cos, c + d, 1), 1);
                float b = ops_round(ops_ld(x, o + (d < half ? d + half : d - half), 1) * ops_ld(sin_signed, c + d, 1), 1);
                tmp[d] = ops_f32_to_bf16(a + b);
            }
            memcpy((uint16_t *)out + oo, tmp, sizeof(uint16_t) * D);
        }
    }
}


/* out = silu(gate) * up with gate, up the two halves of each row of x: [rows, 2 * inter] (rows
 * x_stride elements apart); out contiguous [rows, inter]. silu(g) = g / (1 + exp(-g)), rounded to
 * the dtype, then the product rounded. */
void ae_ops_silu_mul(const void *x, long x_stride, void *out, int rows, int inter, int bf16, int parallel) {
    const int isa = ops_isa();
#pragma omp parallel for if (parallel) schedule(static)
    for (long r = 0; r < rows; r++) {
        long xo = r * x_stride, oo = r * (long)inter;
        int d = OPS_VEC(isa, ov_silu_row, x, xo, out, oo, inter, bf16);
        for (; d < inter; d++) {
            float gv = ops_ld(x, xo + d, bf16);
            float s = ops_round(gv / (1.0f + expf(-gv)), bf16);
            ops_st(out, oo + d, s * ops_ld(x, xo + inter + d, bf16), bf16);
        }
    }
}
