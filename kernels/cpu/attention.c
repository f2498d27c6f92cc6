/* Paged attention for CPU: every query row of a step attends over its sequence's K/V read straight
 * from the paged cache through the block table (no gather copy), with an online softmax.
 *
 * Cache layout (shared with the torch backend, so its prefill path reads the same tensors): per
 * layer, k and v each [num_kv_heads, num_blocks, block_size, head_dim]; a (head, block) pair is one
 * contiguous block_size x head_dim slab. Values are fp32 or bf16 (converted to fp32 as loaded);
 * all arithmetic is fp32.
 *
 * Work items are (sequence, kv head, tile of query rows): the rows of a tile are the query heads
 * that share the kv head (GQA/MQA) for up to a few query tokens, so each K/V slab is loaded once per
 * tile and reused by every row while it sits in L1. Rows are causal (a row at position p sees keys
 * [0, p]), optionally limited to a sliding window (keys (p - window, p]).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention_amx.h"
#include "attention_rows.h"
#include "simd.h"

static inline float attn_bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion. */
static inline uint16_t attn_bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float attn_load(const void *base, long i, int bf16) {
    return bf16 ? attn_bf16_load((const uint16_t *)base + i) : ((const float *)base)[i];
}

#ifdef __AVX2__
#define ATTN_AVX2 (isa >= AE_ISA_AVX2) /* the AVX2 loops below, unless a lower ISA is forced */
static inline __m256 attn_load8(const void *base, long i, int bf16) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + i);
}

/* q . k_j for the 8 keys j0..j0+7 of a slab: 8 accumulators over D, then one transposing reduction. */
static inline __m256 attn_dot8(const float *q, const void *kb, long j0, int D, int bf16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    long o = j0 * D;
    for (int d = 0; d < D; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, attn_load8(kb, o + 0L * D + d, bf16), a0);
        a1 = _mm256_fmadd_ps(qv, attn_load8(kb, o + 1L * D + d, bf16), a1);
        a2 = _mm256_fmadd_ps(qv, attn_load8(kb, o + 2L * D + d, bf16), a2);
        a3 = _mm256_fmadd_ps(qv, attn_load8(kb, o + 3L * D + d, bf16), a3);
        a4 = _mm256_fmadd_ps(qv, attn_load8(kb, o + 4L * D + d, bf16), a4);
        a5 = _mm256_fmadd_ps(qv, attn_load8(kb, o + 5L * D + d, bf16), a5);
        a6 = _mm256_fmadd_ps(qv, attn_load8(kb, o + 6L * D + d, bf16), a6);
        a7 = _mm256_fmadd_ps(qv, attn_load8(kb, o + 7L * D + d, bf16), a7);
    }
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* One work item: rows [0, nr) (query vectors qf, pre-scaled, at positions qpos) over the cache
 * slabs of one kv head, keys [klo, khi) only. Without mo: leaves each row's softmax-weighted value
 * sum normalised in acc. With mo / lo: a partial over that key range, for a merge (split over
 * keys): acc unnormalised, each row's running max in mo and its sum of exponentials in lo. */
static inline __attribute__((always_inline)) void attn_rows(
        const float *qf, const int *qpos, int nr, const void *kc, const void *vc, const int32_t *table,
        long head_off, int bs, int D, int bf16, int window, float *acc, int klo, int khi, float *mo,
        float *lo_out, int isa, float cap) {
    float m[AE_ATTN_ROW_TILE], l[AE_ATTN_ROW_TILE];
    float s[AE_ATTN_MAX_BS];
    int pmin = 1 << 30, pmax = -1;
    for (int r = 0; r < nr; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(acc + (long)r * D, 0, sizeof(float) * D);
        if (qpos[r] < pmin) pmin = qpos[r];
        if (qpos[r] > pmax) pmax = qpos[r];
    }
    int lo_all = window > 0 ? pmin - window + 1 : 0;
    if (lo_all < klo) lo_all = klo;
    if (lo_all < 0) lo_all = 0;
    if (pmax > khi - 1) pmax = khi - 1;
    for (int b = lo_all / bs; b <= pmax / bs; b++) {
        long slab = head_off + (long)table[b] * bs * D;
        const void *kb = bf16 ? (const void *)((const uint16_t *)kc + slab) : (const void *)((const float *)kc + slab);
        const void *vb = bf16 ? (const void *)((const uint16_t *)vc + slab) : (const void *)((const float *)vc + slab);
        int kstart = b * bs;
        for (int r = 0; r < nr; r++) {
            int hi = qpos[r], lo = window > 0 ? qpos[r] - window + 1 : 0;
            if (lo < klo) lo = klo;
            if (hi > khi - 1) hi = khi - 1;
            int j0 = lo - kstart, j1 = hi - kstart + 1;
            if (j0 < 0) j0 = 0;
            if (j1 > bs) j1 = bs;
            if (j0 >= j1) continue;
            const float *q = qf + (long)r * D;
            float *a = acc + (long)r * D;
            float mx = -INFINITY;
#ifdef __AVX2__
            if (ATTN_AVX2 && (D & 7) == 0 && (bs & 7) == 0) {
                for (int c = j0 & ~7; c < j1; c += 8) {
                    __m256 sv = attn_dot8(q, kb, c, D, bf16);
                    _mm256_storeu_ps(s + c, sv);
                }
            } else
#endif
            {
                for (int j = j0; j < j1; j++) {
                    float dot = 0.0f;
                    for (int d = 0; d < D; d++) dot += q[d] * attn_load(kb, (long)j * D + d, bf16);
                    s[j] = dot;
                }
            }
            if (cap > 0.0f) { /* Gemma 2: the same bits on every ISA (attention_rows.h, simd.h) */
                int j = j0;
#ifdef __AVX2__
                for (; ATTN_AVX2 && j + 8 <= j1; j += 8) _mm256_storeu_ps(s + j, ae_softcap8(_mm256_loadu_ps(s + j), cap));
#endif
                for (; j < j1; j++) s[j] = attn_softcap1(s[j], cap);
            }
            for (int j = j0; j < j1; j++) mx = s[j] > mx ? s[j] : mx;
            float mnew = mx > m[r] ? mx : m[r];
            float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - mnew);
            float sum = 0.0f;
            int j = j0;
#ifdef __AVX2__
            __m256 mv = _mm256_set1_ps(mnew);
            __m256 sumv = _mm256_setzero_ps();
            for (; ATTN_AVX2 && j + 8 <= j1; j += 8) {
                __m256 p = ae_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
                _mm256_storeu_ps(s + j, p);
                sumv = _mm256_add_ps(sumv, p);
            }
            sum = ae_hsum8(sumv);
#endif
            for (; j < j1; j++) {
                s[j] = expf(s[j] - mnew);
                sum += s[j];
            }
            l[r] = l[r] * corr + sum;
            m[r] = mnew;
            if (corr != 1.0f)
                for (int d = 0; d < D; d++) a[d] *= corr;
            for (j = j0; j < j1; j++) {
                float p = s[j];
                long o = (long)j * D;
#ifdef __AVX2__
                if (ATTN_AVX2 && (D & 7) == 0) {
                    __m256 pv = _mm256_set1_ps(p);
                    for (int d = 0; d < D; d += 8)
                        _mm256_storeu_ps(a + d, _mm256_fmadd_ps(pv, attn_load8(vb, o + d, bf16), _mm256_loadu_ps(a + d)));
                    continue;
                }
#endif
                for (int d = 0; d < D; d++) a[d] += p * attn_load(vb, o + d, bf16);
            }
        }
    }
    struct attn_rows_args fin = {.nr = nr, .acc = acc, .mo = mo, .lo_out = lo_out};
    attn_rows_finish(&fin, m, l, D);
}

/* One (sequence, kv head, row tile), over keys [klo, khi): load its query rows, attend, store the
 * outputs; or, with part (a split over keys), store the partial there: nr rows of D unnormalised
 * sums, then nr maxima, then nr sums of exponentials (attn_merge combines them). */
static inline __attribute__((always_inline)) void attn_item(
        const void *q, long q_stride, void *out, const void *kc, const void *vc, const int32_t *table,
        int qstart, int ctx, int h, int r0, int r1, int g, int Hkv, int NB, int bs, int D, float scale,
        int window, int bf16, int klo, int khi, float *part, int isa, float softcap) {
    float qf[AE_ATTN_ROW_TILE * AE_ATTN_MAX_D];
    uint16_t qb[AE_ATTN_ROW_TILE * AE_ATTN_MAX_D];
    float acc[AE_ATTN_ROW_TILE * AE_ATTN_MAX_D];
    int qpos[AE_ATTN_ROW_TILE];
    int nr = r1 - r0;
    int Hq = Hkv * g;
    for (int r = 0; r < nr; r++) {
        int row = r0 + r, i = row / g, head = h * g + row % g;  /* rows: (query token, head in group) */
        long src = (long)(qstart + i) * q_stride + (long)head * D;
        for (int d = 0; d < D; d++) qf[(long)r * D + d] = attn_load(q, src + d, bf16) * scale;
        if (bf16) memcpy(qb + (long)r * D, (const uint16_t *)q + src, sizeof(uint16_t) * D);
        qpos[r] = ctx + i;
    }
    struct attn_rows_args A = {qf, bf16 ? qb : NULL, scale, qpos, nr, kc, vc, table, (long)h * NB * bs * D, bs, D,
                               window, part ? part : acc, klo, khi, part ? part + (long)nr * D : NULL,
                               part ? part + (long)nr * D + nr : NULL, softcap};
    if (!attn_rows_avx512(&A, bf16, isa))
        attn_rows(qf, qpos, nr, kc, vc, table, A.head_off, bs, D, bf16, window, A.acc, klo, khi, A.mo, A.lo_out, isa,
                  softcap);
    if (part) return;
    for (int r = 0; r < nr; r++) {
        int row = r0 + r, i = row / g, head = h * g + row % g;
        long dst = ((long)(qstart + i) * Hq + head) * D;
        const float *a = acc + (long)r * D;
        if (bf16)
            for (int d = 0; d < D; d++) ((uint16_t *)out)[dst + d] = attn_bf16_store(a[d]);
        else
            memcpy((float *)out + dst, a, sizeof(float) * D);
    }
}

/* The nparts partials of one (sequence, kv head, row tile), in key order, into its outputs:
 * out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p, M = max_p m_p (a fixed order: the same
 * bits whatever else is in the batch). */
static void attn_merge(const float *parts, long part_stride, int nparts, int nr, int D, void *out, int qstart,
                       int h, int r0, int g, int Hq, int bf16) {
    float a[AE_ATTN_MAX_D];
    for (int r = 0; r < nr; r++) {
        float M = -INFINITY, L = 0.0f;
        for (int p = 0; p < nparts; p++) {
            float mp = parts[p * part_stride + (long)nr * D + r];
            M = mp > M ? mp : M;
        }
        memset(a, 0, sizeof(float) * D);
        for (int p = 0; p < nparts; p++) {
            const float *pp = parts + p * part_stride;
            float mp = pp[(long)nr * D + r];
            if (mp == -INFINITY) continue; /* no keys of this row in this split */
            float w = expf(mp - M);
            L += w * pp[(long)nr * D + nr + r];
            for (int d = 0; d < D; d++) a[d] += w * pp[(long)r * D + d];
        }
        float inv = L > 0.0f ? 1.0f / L : 0.0f;
        int row = r0 + r, i = row / g, head = h * g + row % g;
        long dst = ((long)(qstart + i) * Hq + head) * D;
        for (int d = 0; d < D; d++) {
            if (bf16)
                ((uint16_t *)out)[dst + d] = attn_bf16_store(a[d] * inv);
            else
                ((float *)out)[dst + d] = a[d] * inv;
        }
    }
}

/* Splits over keys (off by default): with ae_attn_set_split(n > 0), a sequence whose query rows fit
 * one row tile (decode, a few speculative rows) and whose keys exceed n has them cut into runs of
 * n, partials merged in key order, so one long chat (3 kv heads on 2 threads) could keep every
 * thread busy. The choice depends on the sequence alone, never on the rest of the batch or the
 * thread count (a sequence gets the same bits alone or batched). Off because measured slower on
 * our 2-core EPYC (one sequence, 2 threads, load ~3: 1,000 keys 36 us whole vs 46 us in runs of
 * 256; 4,000 keys 114 vs 149-155 us, best of 30): the whole-sequence items are already bound by
 * reading K/V, and 3 items on 2 threads cost less than the extra items and the merge pass.
 * 0 or -1: never split. */
static int g_split = -1;

static inline int attn_splits(int split, int rows, int keys) {
    return split > 0 && rows <= AE_ATTN_ROW_TILE && keys > split ? (keys + split - 1) / split : 1;
}

void ae_attn_set_split(int keys) { g_split = keys; }

#define AE_ATTN_SMALL_BATCH 1024

/* The sequence s with first[s] <= i < first[s + 1] (first: n + 1 ascending sums; empty runs skipped). */
static inline int attn_owner(const long *first, int n, long i) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Attention of the query rows of num_seqs sequences.
 *   q: [T, Hq, D] rows q_stride elements apart (head and dim contiguous); out: [T, Hq, D] contiguous
 *   k_cache, v_cache: [Hkv, NB, bs, D]; block_ids/block_starts: CSR block tables (sequence s owns
 *   block_ids[block_starts[s] .. block_starts[s+1]))
 *   query_starts, query_lens, context_lens: per sequence (context = tokens cached before its rows;
 *   this step's keys are already in the cache)
 *   window: sliding window (0 = none); softcap: scaled scores -> softcap * tanh(s / softcap) before the
 *   softmax (Gemma 2; 0 = none); bf16: q, out and cache are bfloat16 (else float32)
 *   parallel: run the items over the OpenMP threads (the caller decides: small steps stay serial)
 */
void ae_attn_paged(const void *q, long q_stride, void *out, const void *k_cache, const void *v_cache,
                   const int32_t *block_ids, const int32_t *block_starts, const int32_t *query_starts,
                   const int32_t *query_lens, const int32_t *context_lens, int num_seqs, int Hq, int Hkv,
                   int D, int NB, int bs, float scale, int window, float softcap, int bf16, int parallel) {
    void *amx = NULL; /* many-row sequences as tile products; the rest (decodes) below */
    if (bf16 && g_split <= 0 && ae_isa() >= AE_ISA_AMX_BF16 && ae_attn_amx_takes(D, bs))
        amx = ae_attn_paged_amx(q, q_stride, out, k_cache, v_cache, block_ids, block_starts, query_starts,
                                query_lens, context_lens, num_seqs, Hq, Hkv, D, NB, bs, scale, window, softcap,
                                parallel, &query_lens);
    int g = Hq / Hkv;
    /* items: per sequence, Hkv x ceil(rows / tile) x splits; count them, then index through sums */
    long groups = 0;
    for (int s = 0; s < num_seqs; s++)
        groups += (long)((query_lens[s] * g + AE_ATTN_ROW_TILE - 1) / AE_ATTN_ROW_TILE) * Hkv;
    int split = g_split;
    long total = 0, split_items = 0;
    int part_rows = 1;
    /* first item and first merge group of each sequence: an item finds its sequence by binary search
     * (a scan from sequence 0 per item cost O(sequences^2): ~130k loop steps a call at 256 decode
     * rows x 4 KV heads) */
    long first_small[2 * (AE_ATTN_SMALL_BATCH + 1)]; /* on the stack up to this many sequences */
    long *first = num_seqs <= AE_ATTN_SMALL_BATCH ? first_small
                                                  : (long *)malloc(sizeof(long) * 2 * ((size_t)num_seqs + 1));
    if (!first) { /* a few KB of host memory not to be had: no safe way to go on */
        fprintf(stderr, "asyncengine: out of memory in paged attention (%d sequences)\n", num_seqs);
        abort();
    }
    long *first_group = first + num_seqs + 1;
    first[0] = first_group[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        long gs = (long)((query_lens[s] * g + AE_ATTN_ROW_TILE - 1) / AE_ATTN_ROW_TILE) * Hkv;
        int np = attn_splits(split, query_lens[s] * g, context_lens[s] + query_lens[s]);
        total += gs * np;
        first[s + 1] = total;
        first_group[s + 1] = first_group[s] + gs;
        if (np > 1) {
            split_items += gs * np;
            if (query_lens[s] * g > part_rows) part_rows = query_lens[s] * g;
        }
    }
    const long part_stride = (long)part_rows * (D + 2); /* one partial: rows x D sums, rows maxima and sums */
    float *parts = NULL;
    if (split_items) {
        parts = (float *)malloc(sizeof(float) * (size_t)total * (size_t)part_stride);
        if (!parts) { /* no memory for the partials: unsplit */
            split = -1, total = groups;
            memcpy(first, first_group, sizeof(long) * ((size_t)num_seqs + 1));
        }
    }
    const int isa = ae_isa();
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < total; it++) {
            const int s = attn_owner(first, num_seqs, it);
            long rem = it - first[s];
            const int tiles = (query_lens[s] * g + AE_ATTN_ROW_TILE - 1) / AE_ATTN_ROW_TILE;
            const int np = attn_splits(split, query_lens[s] * g, context_lens[s] + query_lens[s]);
            int p = (int)(rem % np);
            rem /= np;
            int h = (int)(rem / tiles), t = (int)(rem % tiles);
            int rows = query_lens[s] * g;
            int r0 = t * AE_ATTN_ROW_TILE, r1 = r0 + AE_ATTN_ROW_TILE < rows ? r0 + AE_ATTN_ROW_TILE : rows;
            const int32_t *table = block_ids + block_starts[s];
            int klo = np > 1 ? p * split : 0, khi = np > 1 ? (p + 1) * split : 1 << 30;
            float *part = np > 1 ? parts + it * part_stride : NULL;
            /* constant head dims and cache type, so the compiler specialises attn_item's loops */
#define AE_ATTN_CALL(DIM, BF16) attn_item(q, q_stride, out, k_cache, v_cache, table, query_starts[s], \
                                          context_lens[s], h, r0, r1, g, Hkv, NB, bs, DIM, scale, window, BF16, \
                                          klo, khi, part, isa, softcap)
            if (D == 64) { if (bf16) AE_ATTN_CALL(64, 1); else AE_ATTN_CALL(64, 0); }
            else if (D == 128) { if (bf16) AE_ATTN_CALL(128, 1); else AE_ATTN_CALL(128, 0); }
            else { if (bf16) AE_ATTN_CALL(D, 1); else AE_ATTN_CALL(D, 0); }
#undef AE_ATTN_CALL
        }
        if (parts) {
            /* merge: one pass per split group (items of a group are consecutive, p fastest) */
#pragma omp for schedule(dynamic, 1)
            for (long gi = 0; gi < groups; gi++) {
                const int s = attn_owner(first_group, num_seqs, gi);
                const long rem = gi - first_group[s], base = first[s];
                const int tiles = (query_lens[s] * g + AE_ATTN_ROW_TILE - 1) / AE_ATTN_ROW_TILE;
                const int np = attn_splits(split, query_lens[s] * g, context_lens[s] + query_lens[s]);
                if (np == 1) continue;
                int h = (int)(rem / tiles), t = (int)(rem % tiles);
                int rows = query_lens[s] * g;
                int r0 = t * AE_ATTN_ROW_TILE, r1 = r0 + AE_ATTN_ROW_TILE < rows ? r0 + AE_ATTN_ROW_TILE : rows;
                attn_merge(parts + (base + rem * np) * part_stride, part_stride, np, r1 - r0, D, out,
                           query_starts[s], h, r0, g, Hq, bf16);
            }
        }
    }
    free(parts);
    if (first != first_small) free(first);
    free(amx);
}

/* Write this step's keys and values into their cache slots (slot = block * bs + offset; < 0: skip).
 * k, v: [T, Hkv, D] rows k_stride / v_stride elements apart; caches [Hkv, NB, bs, D]; elem: bytes
 * per element (the step's tensors have the cache's dtype, so this is a copy). */
void ae_attn_write_kv(const void *k, long k_stride, const void *v, long v_stride, void *k_cache, void *v_cache,
                      const int64_t *slots, int T, int Hkv, int D, long NB, int bs, int elem) {
    long head_stride = NB * bs * D;
    size_t row = (size_t)D * elem;
    for (int t = 0; t < T; t++) {
        long slot = slots[t];
        if (slot < 0) continue;
        for (int h = 0; h < Hkv; h++) {
            long dst = (h * head_stride + slot * D) * elem;
            memcpy((char *)k_cache + dst, (const char *)k + ((long)t * k_stride + (long)h * D) * elem, row);
            memcpy((char *)v_cache + dst, (const char *)v + ((long)t * v_stride + (long)h * D) * elem, row);
        }
    }
}

/* A layer's whole attention in one call: write the step's K/V, then attend (ae_attn_paged). */
void ae_attn_write_and_attend(const void *k, long k_stride, const void *v, long v_stride, const int64_t *slots,
                              int T, const void *q, long q_stride, void *out, void *k_cache, void *v_cache,
                              const int32_t *block_ids, const int32_t *block_starts, const int32_t *query_starts,
                              const int32_t *query_lens, const int32_t *context_lens, int num_seqs, int Hq, int Hkv,
                              int D, int NB, int bs, float scale, int window, float softcap, int bf16,
                              int parallel) {
    ae_attn_write_kv(k, k_stride, v, v_stride, k_cache, v_cache, slots, T, Hkv, D, NB, bs, bf16 ? 2 : 4);
    if (num_seqs > 0)
        ae_attn_paged(q, q_stride, out, k_cache, v_cache, block_ids, block_starts, query_starts, query_lens,
                      context_lens, num_seqs, Hq, Hkv, D, NB, bs, scale, window, softcap, bf16, parallel);
}
