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

static float dot(const float *a, const float *b, long n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (long i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* tmp[row, pk] = x[row] . A_s[pk] for each (slot, part * R + k): one read of each A row per slot. */
static void shrink(const ae_lora_proj *p, const ae_lora_groups *g, const float *x, long ldx, long K, int nparts,
                   int par, int nthreads) {
    const int S = g->num_slots, R = g->max_rank, W = 3 * R, items = S * nparts * R;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int it = 0; it < items; it++) {
        const int s = it / (nparts * R), pk = it % (nparts * R);
        const int n0 = g->start[s], n1 = g->start[s + 1];
        if (n0 == n1 || pk % R >= p->rank[s]) continue;
        const float *arow = p->a + ((size_t)s * nparts * R + pk) * (size_t)K;
        for (int i = n0; i < n1; i++) {
            const int row = g->order[i];
            g->tmp[(size_t)row * W + pk] = dot(x + (size_t)row * ldx, arow, K);
        }
    }
}

void ae_lora_apply(const ae_lora_proj *p, const ae_lora_groups *g, const float *x, long ldx, long K, float *y,
                   long ldy, const long *parts, int nparts, int nthreads) {
    const int S = g->num_slots, R = g->max_rank, W = 3 * R;
    long N = 0, chunks = 0, work = 0;
    for (int q = 0; q < nparts; q++) N += parts[q], chunks += (parts[q] + CHUNK - 1) / CHUNK;
    for (int s = 0; s < S; s++) work += (long)(g->start[s + 1] - g->start[s]) * p->rank[s];
    if (!work || nparts > 3) return; /* (3: the tmp rows hold qkv's parts, the most) */
    const int par = nthreads > 1 && work * nparts * (K + N) >= (1L << 16);
    shrink(p, g, x, ldx, K, nparts, par, nthreads);
    /* y[row, j] += tmp[row, part's rank block] . Bt_s[.., j]: each item one slot's chunk of one part's
     * columns, over all of the slot's rows; its delta is summed apart, then added once (as torch's
     * y += (x A^T) B^T) */
    const long items = (long)S * chunks;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (long it = 0; it < items; it++) {
        const int s = (int)(it / chunks), r = p->rank[s];
        const int n0 = g->start[s], n1 = g->start[s + 1];
        if (n0 == n1 || r == 0) continue;
        long c = it % chunks, col = 0;
        int q = 0;
        while (c >= (parts[q] + CHUNK - 1) / CHUNK) c -= (parts[q] + CHUNK - 1) / CHUNK, col += parts[q++];
        const long j0 = col + c * CHUNK, len = (col + parts[q] - j0) < CHUNK ? col + parts[q] - j0 : CHUNK;
        for (int i = n0; i < n1; i++) {
            const int row = g->order[i];
            const float *t = g->tmp + (size_t)row * W + (size_t)q * R;
            float acc[CHUNK] = {0};
            for (int k = 0; k < r; k++) {
                const float tk = t[k], *bk = p->bt + ((size_t)s * R + k) * (size_t)N + j0;
#pragma omp simd
                for (long j = 0; j < len; j++) acc[j] += tk * bk[j];
            }
            float *yr = y + (size_t)row * ldy + j0;
#pragma omp simd
            for (long j = 0; j < len; j++) yr[j] += acc[j];
        }
    }
}
