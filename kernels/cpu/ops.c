/* The small per-layer ops of a decoder, fused: RMSNorm (with the residual add), rotary embedding in
 * place, SiLU-and-mul. Each replaces a handful of torch ops (and their dispatch, ~5-10 us apiece at
 * decode sizes) with one call, and reproduces the torch code's rounding steps: fp32 math, results
 * rounded to the tensors' dtype (float32 or bfloat16) where torch rounds them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

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
                                int bf16) {
    float ss = 0.0f;
    if (!bf16) {
        const float *xf = (const float *)x + xo;
        for (int d = 0; d < dim; d++) ss += xf[d] * xf[d];
    } else {
        for (int d = 0; d < dim; d++) {
            float v = ops_ld(x, xo + d, 1);
            ss += v * v;
        }
    }
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
    if (!bf16) {
        const float *xf = (const float *)x + xo, *wf = (const float *)w;
        float *of = (float *)out + oo;
        for (int d = 0; d < dim; d++) of[d] = wf[d] * (xf[d] * r);
    } else {
        for (int d = 0; d < dim; d++)
            ops_st(out, oo + d, ops_ld(w, d, 1) * ops_round(ops_ld(x, xo + d, 1) * r, 1), 1);
    }
}

/* RMSNorm over the last dim of x viewed as [n_outer, n_inner, dim] with strides (outer, inner)
 * in elements; out is contiguous [n_outer * n_inner, dim]. */
void ae_ops_rms_norm(const void *x, long outer_stride, long inner_stride, int n_outer, int n_inner, void *out,
                     const void *w, int dim, float eps, int bf16, int parallel) {
    long rows = (long)n_outer * n_inner;
#pragma omp parallel for if (parallel) schedule(static)
    for (long r = 0; r < rows; r++) {
        long xo = (r / n_inner) * outer_stride + (r % n_inner) * inner_stride;
        ops_norm_row(x, xo, out, r * dim, w, dim, eps, bf16);
    }
}

/* s = x + residual (rounded to the dtype), out = RMSNorm(s); x, residual, sum_out and out are
 * contiguous [rows, dim]. */
void ae_ops_add_rms_norm(const void *x, const void *residual, void *sum_out, void *out, const void *w, int rows,
                         int dim, float eps, int bf16, int parallel) {
#pragma omp parallel for if (parallel) schedule(static)
    for (long r = 0; r < rows; r++) {
        long o = r * dim;
        if (!bf16) {
            const float *a = (const float *)x + o, *b = (const float *)residual + o;
            float *s = (float *)sum_out + o;
            for (int d = 0; d < dim; d++) s[d] = a[d] + b[d];
        } else {
            for (int d = 0; d < dim; d++) ops_st(sum_out, o + d, ops_ld(x, o + d, 1) + ops_ld(residual, o + d, 1), 1);
        }
        ops_norm_row(sum_out, o, out, o, w, dim, eps, bf16);
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
#pragma omp parallel for if (parallel) schedule(static)
    for (long th = 0; th < (long)T * H; th++) {
        long t = th / H, h = th % H;
        long o = t * x_stride + h * D, oo = t * out_stride + h * D;
        const long c = t * D;
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
#pragma omp parallel for if (parallel) schedule(static)
    for (long r = 0; r < rows; r++) {
        long xo = r * x_stride, oo = r * (long)inter;
        int d = 0;
#ifdef __AVX2__
        if (!bf16) {
            const float *g = (const float *)x + xo, *u = g + inter;
            float *o = (float *)out + oo;
            __m256 one = _mm256_set1_ps(1.0f);
            for (; d + 8 <= inter; d += 8) {
                __m256 gv = _mm256_loadu_ps(g + d);
                __m256 e = ae_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
                __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
                _mm256_storeu_ps(o + d, _mm256_mul_ps(s, _mm256_loadu_ps(u + d)));
            }
        }
#endif
        for (; d < inter; d++) {
            float gv = ops_ld(x, xo + d, bf16);
            float s = ops_round(gv / (1.0f + expf(-gv)), bf16);
            ops_st(out, oo + d, s * ops_ld(x, xo + inter + d, bf16), bf16);
        }
    }
}
