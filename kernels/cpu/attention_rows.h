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

/* Soft-cap scores [j0, j1) in place: a scalar tanhf per score, so every ISA's loop caps a score to
 * the same bits (a vector tanh would differ per ISA); a no-op where cap is 0. */
static inline void attn_softcap(float *s, int j0, int j1, float cap) {
    if (cap > 0.0f)
        for (int j = j0; j < j1; j++) s[j] = cap * tanhf(s[j] / cap);
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
