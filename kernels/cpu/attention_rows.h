/* What attention.c hands its per-ISA item loops (attention_avx512.c): one work item's rows. */
#ifndef AE_ATTENTION_ROWS_H
#define AE_ATTENTION_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define AE_ATTN_MAX_D 512
#define AE_ATTN_MAX_BS 256
#define AE_ATTN_ROW_TILE 16

struct attn_rows_args {
    const float *qf;      /* nr rows of D: q * scale in fp32 */
    const uint16_t *qb;   /* nr rows of D: q as stored (bf16 caches only; for vdpbf16ps), else NULL */
    float scale;
    const int *qpos;      /* each row's position: it sees keys [qpos - window + 1, qpos] */
    int nr;
    const void *kc, *vc;  /* the layer's caches [Hkv, NB, bs, D] */
    const int32_t *table; /* the sequence's block ids */
    long head_off;        /* elements to this kv head's blocks */
    int bs, D, window;
    float *acc;           /* out: nr rows of D */
    int klo, khi;         /* keys [klo, khi) only (a split over keys) */
    float *mo, *lo_out;   /* a split's partial: acc unnormalised, row maxima and sums here */
    float softcap;        /* > 0: each scaled score s -> softcap * tanh(s / softcap) (Gemma 2); 0: off */
};

/* An optimisation barrier on a float: it must be rounded as written, not fused (-ffp-contract=fast). */
#if defined(__x86_64__) || defined(__i386__)
#define AE_FP_BARRIER(v) __asm__("" : "+x"(v))
#elif defined(__aarch64__)
#define AE_FP_BARRIER(v) __asm__("" : "+w"(v))
#else
#define AE_FP_BARRIER(v) __asm__("" : "+m"(v))
#endif

/* One score soft-capped: cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1), exp by the Cephes
 * polynomial of simd.h's ae_exp8/ae_exp16 step for step (fmaf where they fuse), so the scalar loop
 * and the vector loops (simd.h ae_softcap8/16) give the same bits. Absolute error ~1e-7 * cap. */
static inline float attn_softcap1(float s, float cap) {
    float x = s / cap;
    x = x + x;
    x = x < 88.3762626647949f ? x : 88.3762626647949f;
    x = x > -88.3762626647949f ? x : -88.3762626647949f;
    float fx = floorf(fmaf(x, 1.44269504088896341f, 0.5f));
    x = fmaf(-fx, 0.693359375f, x);
    x = fmaf(-fx, -2.12194440e-4f, x);
    float y = 1.9875691500E-4f;
    y = fmaf(y, x, 1.3981999507E-3f);
    y = fmaf(y, x, 8.3334519073E-3f);
    y = fmaf(y, x, 4.1665795894E-2f);
    y = fmaf(y, x, 1.6666665459E-1f);
    y = fmaf(y, x, 5.0000001201E-1f);
    float xx = x * x;
    y = fmaf(y, xx, x + 1.0f);
    uint32_t bits = (uint32_t)((int)fx + 127) << 23;
    float p2;
    memcpy(&p2, &bits, 4);
    float e = y * p2;
    AE_FP_BARRIER(e); /* no fma of this multiply into the add below */
    float r = cap * (1.0f - 2.0f / (e + 1.0f));
    AE_FP_BARRIER(r);
    return r;
}

/* Normalise the rows (or hand the partial's maxima and sums to the merge). */
static inline void attn_rows_finish(const struct attn_rows_args *A, const float *m, const float *l, int D) {
    if (A->mo) {
        memcpy(A->mo, m, sizeof(float) * A->nr);
        memcpy(A->lo_out, l, sizeof(float) * A->nr);
        return;
    }
    for (int r = 0; r < A->nr; r++) {
        float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int d = 0; d < D; d++) A->acc[(long)r * D + d] *= inv;
    }
}

/* The AVX-512 loop (attention_avx512.c): 1 where it ran the item, 0 where it does not take the
 * shapes (block size % 16, head dim % 32) or the ISA level is below AVX-512. */
int attn_rows_avx512(const struct attn_rows_args *A, int bf16, int isa);

#endif
