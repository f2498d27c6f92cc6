/* A mixture-of-experts layer in one native call: router GEMV, top-k routing, the tokens of each
 * active expert gathered into one block, every active expert's GEMM pair through the quantized
 * kernels (quant.c, quant_i8.c) in one OpenMP region (their row blocks shared out over the threads
 * together), the weighted results summed per token in expert-id order, and an optional (gated)
 * shared expert.
 *
 * Why here and not in torch: a decode token of a MoE model runs k experts per layer, each two
 * quantized GEMVs; from Python that is ~20 calls per layer plus the router's softmax, top-k, sort and
 * scatter, several times the layer's arithmetic at batch 1. The per-op model's MoE layer
 * (asyncengine/layers/moe.py) and the native decode step (step.c) both call ae_moe_forward, so
 * the two paths agree bit for bit by construction; the torch grouped path stays the reference for
 * dense experts, long fp32-activation chunks and the router kinds not written here (sigmoid,
 * grouped).
 *
 * Every output row depends on its own token only (the router, each expert's GEMM rows and the sum
 * order are per token), so a token gets the same bits whatever else is in the batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"
#include "quant_common.h"

int ae_q_gemm(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias,
              float *out, int64_t ldo, int accumulate, int nthreads);
int ae_q_prepare_act(int type, const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s, int32_t *xsum);
int ae_q_rows_q8(int type, const int8_t *q, const float *d, const float *s, const int32_t *xsum, int64_t M,
                 int64_t K, const uint8_t *w, int64_t N, int64_t n0, int64_t n1, float *out, int64_t ldo);
void ae_ops_silu_mul(const void *x, long x_stride, void *out, int rows, int inter, int bf16, int parallel);

/* A dot product in a fixed order: 16 lanes (the compiler vectorizes them), then the tail, then the
 * lanes in order. */
static float dot(const float *a, const float *b, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
}

/* v[0..n) -> softmax in place (max subtracted, sum in index order) */
static void softmax(float *v, int n) {
    float m = v[0], sum = 0.0f;
    for (int i = 1; i < n; i++) m = v[i] > m ? v[i] : m;
    for (int i = 0; i < n; i++) sum += (v[i] = expf(v[i] - m));
    for (int i = 0; i < n; i++) v[i] /= sum;
}

/* The k largest of v[0..n) (ties: the lower index first) -> ids, values; taken: n bytes scratch. */
static void top_k(const float *v, int n, int k, char *taken, int32_t *ids, float *vals) {
    memset(taken, 0, (size_t)n);
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < n; i++)
            if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
        taken[best] = 1;
        ids[j] = best;
        vals[j] = v[best];
    }
}

/* One token's experts and weights from its router logits (overwritten). */
static void route(const ae_moe_layer *L, float *logits, char *taken, int32_t *ids, float *w) {
    const int E = L->num_experts, k = L->top_k;
    if (L->kind == AE_MOE_SOFTMAX_TOPK) {
        softmax(logits, E);
        top_k(logits, E, k, taken, ids, w);
    } else { /* top k of the logits, softmax over those k */
        top_k(logits, E, k, taken, ids, w);
        softmax(w, k);
    }
    if (L->renormalize && L->kind != AE_MOE_TOPK_SOFTMAX) { /* (a softmax over the k already sums to one) */
        float sum = 0.0f;
        for (int j = 0; j < k; j++) sum += w[j];
        for (int j = 0; j < k; j++) w[j] /= sum;
    }
    if (L->scale != 1.0f)
        for (int j = 0; j < k; j++) w[j] *= L->scale;
}

/* Tokens per pass: bounds the scratch (a long prefill chunk runs in slabs). Each slab reads the
 * active experts' weights again, yet slabs of 512 were no faster on a 512-token chunk of the bench
 * MoE (14.9-16.9 vs 14.9-15.4 ms), and 128 keeps a Qwen3-30B-sized layer's scratch (~26 MB) under
 * glibc's 32 MB mmap threshold, so it is reused from the heap, not page-faulted in at every call. */
#define AE_MOE_SLAB 128
#define AE_MOE_ROWS 64  /* weight rows per work item (a multiple of the x8 layout's 8-row groups) */

/* One GEMM pair's operands in a pass: an expert (or the shared one) over its gathered rows. */
typedef struct {
    const uint8_t *gate_up, *down;
    int gu_type, down_type, inter, n; /* n: rows of x it runs on */
    const float *xs;                 /* [n, H] */
    float *gu, *act, *y;             /* [n, 2 inter], [n, inter], [n, H] */
} ae_moe_job;

/* A job's input to one of its GEMMs, int8-quantized once for all its row blocks. */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *xsum;
} ae_moe_act;

static int job_rows_of(const ae_moe_job *j, int phase, int H) {
    return phase == 0 ? 2 * j->inter : H;
}

/* fp32 activations: the jobs one after another, each GEMM over all threads. */
static int run_jobs_fp32(const ae_moe_job *jobs, int nj, int H, int nthreads) {
    int rc = 0;
    for (int j = 0; j < nj && !rc; j++) {
        const ae_moe_job *b = jobs + j;
        rc |= ae_q_gemm(b->gu_type, b->xs, b->n, H, b->gate_up, 2 * (int64_t)b->inter, NULL, b->gu,
                        2 * (int64_t)b->inter, 0, nthreads);
        ae_ops_silu_mul(b->gu, 2 * (long)b->inter, b->act, b->n, b->inter, 0, 0);
        rc |= ae_q_gemm(b->down_type, b->act, b->n, b->inter, b->down, H, NULL, b->y, H, 0, nthreads);
    }
    return rc;
}

/* int8 activations: every job's two GEMMs and SiLU-and-mul in one parallel region, the row blocks
 * of all active experts shared out over the threads together (one fork per layer, not two per
 * expert). Each job's inputs are quantized once (a, [2 nj]: its x, then its act). first: [2 (nj +
 * 1)] scratch. Each output row comes from one single-threaded call over a fixed 64-row item, so the
 * bits do not depend on the number of threads. */
static int run_jobs_int8(const ae_moe_job *jobs, int nj, int H, int nthreads, const ae_moe_act *a, int32_t *first) {
    for (int phase = 0; phase < 2; phase++) { /* first[phase][j]: job j's first item */
        int32_t *f = first + phase * (nj + 1);
        f[0] = 0;
        for (int j = 0; j < nj; j++)
            f[j + 1] = f[j] + (job_rows_of(jobs + j, phase, H) + AE_MOE_ROWS - 1) / AE_MOE_ROWS;
    }
    int rc = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : rc) if (nthreads > 1)
    {
#pragma omp for schedule(static)
        for (int j = 0; j < nj; j++)
            rc |= ae_q_prepare_act(jobs[j].gu_type, jobs[j].xs, jobs[j].n, H, a[2 * j].q, a[2 * j].d, a[2 * j].s,
                                   a[2 * j].xsum) != 0;
        for (int phase = 0; phase < 2; phase++) {
            const int32_t *f = first + phase * (nj + 1);
#pragma omp for schedule(static)
            for (int i = 0; i < f[nj]; i++) {
                int j = 0;
                while (f[j + 1] <= i) j++;
                const ae_moe_job *b = jobs + j;
                const ae_moe_act *x = a + 2 * j + phase;
                const int rows = job_rows_of(b, phase, H), r0 = (i - f[j]) * AE_MOE_ROWS;
                const int r1 = r0 + AE_MOE_ROWS < rows ? r0 + AE_MOE_ROWS : rows;
                rc |= (phase == 0 ? ae_q_rows_q8(b->gu_type, x->q, x->d, x->s, x->xsum, b->n, H, b->gate_up, rows, r0,
                                                 r1, b->gu, rows)
                                  : ae_q_rows_q8(b->down_type, x->q, x->d, x->s, x->xsum, b->n, b->inter, b->down, H,
                                                 r0, r1, b->y, H)) != 0;
            }
            if (phase == 0) { /* after the loop's barrier: every gate/up row is done */
#pragma omp for schedule(static)
                for (int j = 0; j < nj; j++) {
                    const ae_moe_job *b = jobs + j;
                    ae_ops_silu_mul(b->gu, 2 * (long)b->inter, b->act, b->n, b->inter, 0, 0);
                    rc |= ae_q_prepare_act(b->down_type, b->act, b->n, b->inter, a[2 * j + 1].q, a[2 * j + 1].d,
                                           a[2 * j + 1].s, a[2 * j + 1].xsum) != 0;
                }
            }
        }
    }
    return rc;
}

/* The jobs' GEMMs; -1 on a failed GEMM, -2 when out of memory. */
static int run_jobs(const ae_moe_job *jobs, int nj, int H, int act_int8, int nthreads, int32_t *first) {
    if (!act_int8) return run_jobs_fp32(jobs, nj, H, nthreads) ? -1 : 0;
    size_t nq = 0; /* int8 values of every job's two inputs */
    for (int j = 0; j < nj; j++) nq += (size_t)jobs[j].n * (H + jobs[j].inter);
    int8_t *q = (int8_t *)malloc(nq);
    float *ds = (float *)malloc(sizeof(float) * (nq / 32 + 1) * 2); /* d, then s, per 32 values */
    int32_t *xsum = (int32_t *)malloc(sizeof(int32_t) * (nq / 32 + 1));
    ae_moe_act *a = (ae_moe_act *)malloc(sizeof(ae_moe_act) * 2 * (size_t)(nj > 0 ? nj : 1));
    int rc = -2;
    if (q && ds && xsum && a) {
        size_t o = 0;
        for (int j = 0; j < nj; j++)
            for (int p = 0; p < 2; p++) {
                a[2 * j + p] = (ae_moe_act){q + o, ds + o / 32, ds + nq / 32 + 1 + o / 32, xsum + o / 32};
                o += (size_t)jobs[j].n * (p == 0 ? H : jobs[j].inter);
            }
        rc = run_jobs_int8(jobs, nj, H, nthreads, a, first) ? -1 : 0;
    }
    free(q), free(ds), free(xsum), free(a);
    return rc;
}

/* rows [T, H] += weight * y, or y alone where weights is NULL */
static void add_rows(float *out, const float *y, const int32_t *rows, const float *weights, int n, int H) {
    for (int r = 0; r < n; r++) {
        float *o = out + (size_t)(rows ? rows[r] : r) * H;
        const float *yr = y + (size_t)r * H;
        const float wv = weights ? weights[r] : 1.0f;
        for (int h = 0; h < H; h++) o[h] += wv * yr[h];
    }
}

/* One slab of T <= AE_MOE_SLAB tokens (see ae_moe_forward). */
static int moe_slab(const ae_moe_layer *L, const float *x, int T, int H, float *out, int64_t *load, int nthreads) {
    const int E = L->num_experts, k = L->top_k, nl = L->num_local, I = L->inter, Is = L->shared_inter;
    const size_t pairs = (size_t)T * k, rows = pairs + (L->shared_gate_up ? (size_t)T : 0);
    const int Imax = Is > I ? Is : I;
    /* scratch: logits [E], pair weights [pairs] and grouped [pairs], shared gates [T], gathered rows,
     * gu, act, y [rows, ...]; pair ids, grouped tokens [pairs], group starts [nl + 1], job items */
    const size_t nf = (size_t)E + 2 * pairs + T + rows * (2 * (size_t)H + 3 * (size_t)Imax);
    float *f = (float *)malloc(nf * sizeof(float));
    int32_t *iw = (int32_t *)malloc((2 * pairs + 3 * ((size_t)nl + 2)) * sizeof(int32_t));
    ae_moe_job *jobs = (ae_moe_job *)malloc(sizeof(ae_moe_job) * (size_t)(nl + 1));
    char *taken = (char *)malloc((size_t)E);
    int rc = -2;
    if (!f || !iw || !jobs || !taken) goto done;
    float *logits = f, *pw = logits + E, *gw = pw + pairs, *sg = gw + pairs, *xs = sg + T;
    float *gu = xs + rows * H, *act = gu + rows * 2 * Imax, *y = act + rows * Imax;
    int32_t *pid = iw, *gtok = pid + pairs, *start = gtok + pairs, *first = start + nl + 1;
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * H;
        for (int e = 0; e < E; e++) logits[e] = dot(xt, L->router + (size_t)e * H, H);
        route(L, logits, taken, pid + (size_t)t * k, pw + (size_t)t * k);
    }
    /* group the (token, expert) pairs of this rank's experts by expert, tokens in order */
    memset(start, 0, sizeof(int32_t) * (size_t)(nl + 1));
    for (size_t p = 0; p < pairs; p++) {
        if (load) load[pid[p]]++;
        const int e = pid[p] - L->expert_start;
        if (e >= 0 && e < nl) start[e + 1]++;
    }
    for (int e = 0; e < nl; e++) start[e + 1] += start[e];
    int32_t *fill = first; /* (scratch until run_jobs) */
    memcpy(fill, start, sizeof(int32_t) * (size_t)nl);
    for (size_t p = 0; p < pairs; p++) {
        const int e = pid[p] - L->expert_start;
        if (e >= 0 && e < nl) {
            const int32_t r = fill[e]++;
            gtok[r] = (int32_t)(p / k);
            gw[r] = pw[p];
            memcpy(xs + (size_t)r * H, x + (p / k) * H, sizeof(float) * H);
        }
    }
    int nj = 0;
    for (int e = 0; e < nl; e++) {
        const int n = start[e + 1] - start[e];
        if (!n) continue;
        const size_t r = start[e];
        jobs[nj++] = (ae_moe_job){L->gate_up[e], L->down[e], L->gate_up_type[e], L->down_type[e], I, n,
                                  xs + r * H, gu + r * 2 * Imax, act + r * Imax, y + r * H};
    }
    const size_t rs = pairs; /* the shared expert's rows follow the routed ones */
    if (L->shared_gate_up)
        jobs[nj++] = (ae_moe_job){L->shared_gate_up, L->shared_down, L->shared_gate_up_type, L->shared_down_type, Is,
                                  T, x, gu + rs * 2 * Imax, act + rs * Imax, y + rs * H};
    rc = run_jobs(jobs, nj, H, L->act_int8, nthreads, first);
    if (rc) goto done;
    /* each token's sum in ascending expert order, then its shared expert */
    memset(out, 0, sizeof(float) * (size_t)T * H);
    add_rows(out, y, gtok, gw, start[nl], H);
    if (L->shared_gate_up) {
        if (L->shared_gate)
            for (int t = 0; t < T; t++) sg[t] = 1.0f / (1.0f + expf(-dot(x + (size_t)t * H, L->shared_gate, H)));
        add_rows(out, y + rs * H, NULL, L->shared_gate ? sg : NULL, T, H);
    }
done:
    free(f), free(iw), free(jobs), free(taken);
    return rc;
}

int ae_moe_forward(const ae_moe_layer *L, const float *x, int T, int H, float *out, int64_t *load, int nthreads) {
    const int E = L->num_experts, k = L->top_k, nl = L->num_local;
    if (T < 1 || H < 1 || k < 1 || k > E || nl < 0 || L->expert_start < 0 || L->expert_start + nl > E) return -1;
    for (int t0 = 0; t0 < T; t0 += AE_MOE_SLAB) { /* every token's output depends on that token only */
        const int n = T - t0 < AE_MOE_SLAB ? T - t0 : AE_MOE_SLAB;
        const int rc = moe_slab(L, x + (size_t)t0 * H, n, H, out + (size_t)t0 * H, load, nthreads);
        if (rc) return rc;
    }
    return 0;
}
