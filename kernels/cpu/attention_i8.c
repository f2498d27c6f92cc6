/* Paged attention over an 8-bit KV cache (layout: attention_i8.h): the step's K/V quantized as
 * they are written, and the query rows of many sequences attended with the int8 rows read straight
 * from the block table (dequantized 16 keys at a time in L1, attention_i8_item.h; no dequantized
 * copy of the cache). The query, output and the step's K/V are fp32 or bf16; arithmetic is fp32.
 *
 * Work items are (sequence, kv head, tile of up to 16 query rows) as in attention.c: the rows of a
 * tile are the query heads sharing the kv head for a few query tokens, so each dequantized tile of
 * keys serves all of them. Half the bytes of a bf16 cache (a quarter of fp32) per key read: long
 * contexts, whose decode is bound by reading the cache, run faster (docs/kv_cache_int8.md).
 */
#include <stdio.h>
#include <stdlib.h>

#include "attention_i8.h"
#include "isa.h"

static inline float i8_ld(const void *base, long i, int bf16) {
    if (!bf16) return ((const float *)base)[i];
    uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t i8_bf16_store(float f) { /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Quantize this step's keys and values into their slots (slot = block * bs + offset; < 0: skip).
 * k, v: [T, Hkv, D] fp32 or bf16, rows k_stride / v_stride elements apart; caches int8
 * [Hkv, NB, bs, D + 2]. */
void ae_attn_i8_write_kv(const void *k, long k_stride, const void *v, long v_stride, int8_t *k_cache,
                         int8_t *v_cache, const int64_t *slots, int T, int Hkv, int D, long NB, int bs, int bf16) {
    const long RS = D + 2, head_stride = NB * bs * RS;
    float x[AE_ATTN_MAX_D];
    for (int t = 0; t < T; t++) {
        const long slot = slots[t];
        if (slot < 0) continue;
        for (int h = 0; h < Hkv; h++) {
            for (int d = 0; d < D; d++) x[d] = i8_ld(k, (long)t * k_stride + (long)h * D + d, bf16);
            i8_quantize_row(x, D, k_cache + h * head_stride + slot * RS);
            for (int d = 0; d < D; d++) x[d] = i8_ld(v, (long)t * v_stride + (long)h * D + d, bf16);
            i8_quantize_row(x, D, v_cache + h * head_stride + slot * RS);
        }
    }
}

/* 1: the VNNI loop where it applies (query rows rounded to int8 for QK); 0: the fp32 loops only
 * (tests compare the two; ae_attn_i8_set_fast) */
static int i8_fast = 1;
void ae_attn_i8_set_fast(int on) { i8_fast = on; }

static void (*i8_pick(int isa, int D, int bs))(const struct i8_args *) {
    if (isa >= AE_ISA_AVX512 && D % 64 == 0 && bs % 16 == 0 && i8_fast) return i8_rows_vnni;
    if (isa >= AE_ISA_AVX512 && D % 16 == 0 && bs % 16 == 0) return i8_rows_avx512;
    if (isa >= AE_ISA_AVX2 && D % 8 == 0 && bs % 8 == 0) return i8_rows_avx2;
    return i8_rows_scalar;
}

static inline int i8_owner(const long *first, int n, long i) { /* first[s] <= i < first[s + 1] */
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* One (sequence, kv head, row tile): load its query rows (scaled, fp32), attend, store the outputs. */
static void i8_item(const void *q, long q_stride, void *out, const int8_t *kc, const int8_t *vc,
                    const int32_t *table, int qstart, int ctx, int h, int r0, int r1, int g, int Hkv, int NB, int bs,
                    int D, float scale, int window, float softcap, int bf16, void (*rows)(const struct i8_args *)) {
    float qf[AE_ATTN_ROW_TILE * AE_ATTN_MAX_D], acc[AE_ATTN_ROW_TILE * AE_ATTN_MAX_D];
    int qpos[AE_ATTN_ROW_TILE];
    const int nr = r1 - r0, Hq = Hkv * g;
    for (int r = 0; r < nr; r++) {
        const int row = r0 + r, i = row / g, head = h * g + row % g; /* rows: (query token, head in group) */
        const long src = (long)(qstart + i) * q_stride + (long)head * D;
        for (int d = 0; d < D; d++) qf[(long)r * D + d] = i8_ld(q, src + d, bf16) * scale;
        qpos[r] = ctx + i;
    }
    const long head_off = (long)h * NB * bs * (D + 2);
    struct i8_args A = {qf, qpos, nr, kc + head_off, vc + head_off, table, bs, D, window, softcap, acc};
    rows(&A);
    for (int r = 0; r < nr; r++) {
        const int row = r0 + r, i = row / g, head = h * g + row % g;
        const long dst = ((long)(qstart + i) * Hq + head) * D;
        if (bf16)
            for (int d = 0; d < D; d++) ((uint16_t *)out)[dst + d] = i8_bf16_store(acc[(long)r * D + d]);
        else
            memcpy((float *)out + dst, acc + (long)r * D, sizeof(float) * D);
    }
}

/* Attention of the query rows of num_seqs sequences over the int8 cache; the arguments are
 * ae_attn_paged's (attention.c), the caches int8 [Hkv, NB, bs, D + 2]. */
void ae_attn_i8_paged(const void *q, long q_stride, void *out, const int8_t *k_cache, const int8_t *v_cache,
                      const int32_t *block_ids, const int32_t *block_starts, const int32_t *query_starts,
                      const int32_t *query_lens, const int32_t *context_lens, int num_seqs, int Hq, int Hkv, int D,
                      int NB, int bs, float scale, int window, float softcap, int bf16, int parallel) {
    const int g = Hq / Hkv;
    long *first = (long *)malloc(sizeof(long) * ((size_t)num_seqs + 1));
    if (!first) {
        fprintf(stderr, "asyncengine: out of memory in int8 paged attention (%d sequences)\n", num_seqs);
        abort();
    }
    first[0] = 0;
    for (int s = 0; s < num_seqs; s++)
        first[s + 1] = first[s] + (long)((query_lens[s] * g + AE_ATTN_ROW_TILE - 1) / AE_ATTN_ROW_TILE) * Hkv;
    const long total = first[num_seqs];
    void (*rows)(const struct i8_args *) = i8_pick(ae_isa(), D, bs);
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
    for (long it = 0; it < total; it++) {
        const int s = i8_owner(first, num_seqs, it);
        const long rem = it - first[s];
        const int nrows = query_lens[s] * g, tiles = (nrows + AE_ATTN_ROW_TILE - 1) / AE_ATTN_ROW_TILE;
        const int h = (int)(rem / tiles), t = (int)(rem % tiles);
        const int r0 = t * AE_ATTN_ROW_TILE, r1 = r0 + AE_ATTN_ROW_TILE < nrows ? r0 + AE_ATTN_ROW_TILE : nrows;
        i8_item(q, q_stride, out, k_cache, v_cache, block_ids + block_starts[s], query_starts[s], context_lens[s], h,
                r0, r1, g, Hkv, NB, bs, D, scale, window, softcap, bf16, rows);
    }
    free(first);
}

/* A layer's whole attention in one call: quantize and write the step's K/V, then attend. */
void ae_attn_i8_write_and_attend(const void *k, long k_stride, const void *v, long v_stride, const int64_t *slots,
                                 int T, const void *q, long q_stride, void *out, int8_t *k_cache, int8_t *v_cache,
                                 const int32_t *block_ids, const int32_t *block_starts, const int32_t *query_starts,
                                 const int32_t *query_lens, const int32_t *context_lens, int num_seqs, int Hq,
                                 int Hkv, int D, int NB, int bs, float scale, int window, float softcap, int bf16,
                                 int parallel) {
    ae_attn_i8_write_kv(k, k_stride, v, v_stride, k_cache, v_cache, slots, T, Hkv, D, NB, bs, bf16);
    if (num_seqs > 0)
        ae_attn_i8_paged(q, q_stride, out, k_cache, v_cache, block_ids, block_starts, query_starts, query_lens,
                         context_lens, num_seqs, Hq, Hkv, D, NB, bs, scale, window, softcap, bf16, parallel);
}
