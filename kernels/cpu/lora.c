/* LoRA's grouped low-rank product inside the native decode step (punica's SGMV idea on the CPU):
 * per fused projection, the rows of one adapter slot share one pass over its A and one over its
 * B, never one per request. fp32 throughout. A row's sums run in the same order whatever else is
 * in the batch (batch invariance, issue 24), and base rows (slot -1) are never touched, so a step
 * of base rows only is the plain step's bit for bit. */
#include <stdlib.h>
#include <string.h>

#include "lora.h"

#define CHUNK 64 /* output columns per expand work item (its sums stay in registers) */

void ae_lora_groups_free(ae_lora_groups *g) {
    free(g->order);
    free(g->start);
    free(g->tmp);
    memset(g, 0, sizeof *g);
}

int ae_lora_groups_init(ae_lora_groups *g, const ae_step_lora *lo, int T) {
    memset(g, 0, sizeof *g);
    const int S = lo->num_slots;
    if (S < 1 || lo->max_rank < 1 || !lo->proj || !lo->row_slot) return -1;
    for (int t = 0; t < T; t++)
        if (lo->row_slot[t] < -1 || lo->row_slot[t] >= S) return -1;
    g->order = (int32_t *)malloc(sizeof(int32_t) * (size_t)T);
    g->start = (int32_t *)calloc((size_t)S + 1, sizeof(int32_t));
    g->tmp = (float *)malloc(sizeof(float) * (size_t)T * 3 * (size_t)lo->max_rank);
    if (!g->order || !g->start || !g->tmp) {
        ae_lora_groups_free(g);
        return -2;
    }
    g->num_slots = S, g->max_rank = lo->max_rank, g->T = T;
    int n = 0; /* T is a decode step's rows (at most a few dozen): a pass per slot is cheap */
    for (int s = 0; s < S; s++) {
        for (int t = 0; t < T; t++)
            if (lo->row_slot[t] == s) g->order[n++] = t;
        g->start[s + 1] = n;
    }
    return 0;
}

/* out[i] = x[rows[i]] . a for up to 4 rows: 4 independent sums (the FMA latency hides), one read of
 * a. Each sum runs the same way whichever place its row takes, so a row's bits do not depend on
 * the others (batch invariance). */
static void dot4(const float *a, const float *x, long ldx, const int32_t *rows, int n, long K, float *out) {
    const float *x0 = x + (size_t)rows[0] * ldx, *x1 = n > 1 ? x + (size_t)rows[1] * ldx : x0;
    const float *x2 = n > 2 ? x + (size_t)rows[2] * ldx : x0, *x3 = n > 3 ? x + (size_t)rows[3] * ldx : x0;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (long i = 0; i < K; i++) {
        const float av = a[i];
        s0 += x0[i] * av, s1 += x1[i] * av, s2 += x2[i] * av, s3 += x3[i] * av;
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

/* Slot s, part q: tmp[row, q R + k] = x[row] . A_s[q R + k] for the slot's rows, then
 * y[row, part's columns] += tmp[row, q R ..] Bt_s[.., columns]: one read of the part's A and B for
 * all the slot's rows. The delta of each chunk of columns is summed apart, then added once (as
 * torch's y += (x A^T) B^T). */
static void slot_part(const ae_lora_proj *p, const ae_lora_groups *g, int s, int q, int nparts, const float *x,
                      long ldx, long K, float *y, long ldy, long col, long n, long N) {
    const int R = g->max_rank, W = 3 * R, r = p->rank[s], n0 = g->start[s], n1 = g->start[s + 1];
    const float *a = p->a + ((size_t)s * nparts * R + (size_t)q * R) * (size_t)K;
    for (int k = 0; k < r; k++)
        for (int i = n0; i < n1; i += 4) {
            float d[4];
            const int m = n1 - i < 4 ? n1 - i : 4;
            dot4(a + (size_t)k * K, x, ldx, g->order + i, m, K, d);
            for (int j = 0; j < m; j++) g->tmp[(size_t)g->order[i + j] * W + (size_t)q * R + k] = d[j];
        }
    for (long j0 = col; j0 < col + n; j0 += CHUNK) {
        const long len = col + n - j0 < CHUNK ? col + n - j0 : CHUNK;
        for (int i = n0; i < n1; i++) {
            const int row = g->order[i];
            const float *t = g->tmp + (size_t)row * W + (size_t)q * R;
            float acc[CHUNK] = {0};
            if (len == CHUNK) { /* a constant trip count: the sums stay in registers */
                for (int k = 0; k < r; k++) {
                    const float tk = t[k], *bk = p->bt + ((size_t)s * R + k) * (size_t)N + j0;
#pragma omp simd
                    for (int j = 0; j < CHUNK; j++) acc[j] += tk * bk[j];
                }
            } else {
                for (int k = 0; k < r; k++) {
                    const float tk = t[k], *bk = p->bt + ((size_t)s * R + k) * (size_t)N + j0;
#pragma omp simd
                    for (long j = 0; j < len; j++) acc[j] += tk * bk[j];
                }
            }
            float *yr = y + (size_t)row * ldy + j0;
#pragma omp simd
            for (long j = 0; j < len; j++) yr[j] += acc[j];
        }
    }
}

void ae_lora_apply(const ae_lora_proj *p, const ae_lora_groups *g, const float *x, long ldx, long K, float *y,
                   long ldy, const long *parts, int nparts, int nthreads) {
    const int S = g->num_slots;
    long N = 0, work = 0, cols[4] = {0};
    if (nparts < 1 || nparts > 3) return; /* (3: the tmp rows hold qkv's parts, the most) */
    for (int q = 0; q < nparts; q++) N += parts[q], cols[q + 1] = N;
    for (int s = 0; s < S; s++) work += (long)(g->start[s + 1] - g->start[s]) * p->rank[s];
    if (!work) return;
    /* one work item per (slot, part): one fork per projection, no barrier inside */
    const int par = nthreads > 1 && work * (K * nparts + N) >= (1L << 16);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int it = 0; it < S * nparts; it++) {
        const int s = it / nparts, q = it % nparts;
        if (g->start[s] < g->start[s + 1] && p->rank[s] > 0)
            slot_part(p, g, s, q, nparts, x, ldx, K, y, ldy, cols[q], parts[q], N);
    }
}
