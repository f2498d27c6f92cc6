/* Paged attention as AMX-BF16 tile products, for bf16 caches (isa.c level AE_ISA_AMX_BF16, which
 * the OS has granted this process): the per-row loops of attention.c / attention_avx512.c compute
 * one query row's dot products key by key; here a block of up to 128 query rows of one (sequence,
 * kv head) meets a chunk of 64 keys in two products per 16-row tile, on 16 x 16 tiles.
 *
 * Work items are (sequence, kv head, block of AMX_ROWS rows); rows are (query token, head of the
 * kv head's group), so a decoding sequence's grouped heads share one product (GQA packing; 4+
 * rows, AMX_MIN_ROWS) and a prefill's rows come 32 tokens x 4 heads at a time. Per 64-key chunk (positions 64c .. 64c + 63,
 * whatever the block size), V is packed once (attention_tiles.h) for the item's 16-row tiles; each
 * tile: S^T = K Q^T on AMX (K read straight from the cache, Q^T packed once per item; fp32 sums of
 * exact bf16 products, the scale applied after, as the vdpbf16ps loop), the online softmax in fp32
 * on AVX-512 with the tile's 16 rows in the lanes (no horizontal reductions), P rounded to bf16 and
 * transposed for O = P V (rounding P as vLLM's and SGLang's CPU kernels do), P V accumulated on
 * the tiles onto the fp32 accumulators (tile_pv), whose scale changes only when a row's maximum
 * grows past a margin (tile_softmax).
 *
 * A row's result depends on its own keys only (other keys get P = 0 exactly, and packed keys
 * outside the item's range are zeros), and chunks start at multiples of 64 positions: the same bits
 * alone or in a batch, for blocks of 16, 32 or 64.
 */
#include "attention_amx.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention_tiles.h"

int ae_attn_amx_takes(int D, int bs) { return D > 0 && D % 32 == 0 && D <= 256 && bs > 0 && bs % 16 == 0; }

#if AE_X86

#define TGT AE_TGT_AMX
#define AMX_ROWS 128 /* query rows per item: 8 tiles of 16 share each chunk's packed V */
#define AMX_CHUNK 64 /* keys per online-softmax step: 4 groups of 16 */
#define AMX_MAX_D 256
/* Sequences with fewer query rows (a decode of 1-3 grouped heads) keep the vector loop: their tile
 * would be mostly padding, and the packing is paid per row. Measured (offline workload, bench
 * model, 2 rows per decode): all sequences on tiles ran 0.8-0.9x the vector loops. */
#define AMX_MIN_ROWS 4

struct amx_ws { /* one thread's work space (64-byte aligned: tiles and packs are stored whole) */
    uint16_t q[AMX_ROWS * AMX_MAX_D];   /* the item's query rows, bf16 as stored, zero padded */
    uint16_t qt[AMX_ROWS * AMX_MAX_D];  /* Q^T tiles: [row tile][dim slice of 32] */
    uint16_t vp[AMX_CHUNK * AMX_MAX_D]; /* V tiles: [32-key half][dim slice of 16] */
    float s[AMX_CHUNK * 16];            /* one row tile's scores, [key][row], then its P (fp32) */
    uint16_t p[16 * AMX_CHUNK];         /* its probabilities, bf16 */
    float acc[AMX_ROWS * AMX_MAX_D];
    float m[AMX_ROWS], l[AMX_ROWS], corr[AMX_ROWS];
    int lo[AMX_ROWS], hi[AMX_ROWS];
};

struct amx_item { /* what a chunk step needs to know of its item */
    const uint16_t *kc, *vc;
    const int32_t *table;
    long head_off;
    int nr, D, bs, kmin, kmax;
    float scale, softcap;
};

/* Palette 1, tiles 0-7 all 16 rows x 64 bytes: 0-3 accumulate, 4 holds A, 5-7 hold B. */
static TGT void amx_config(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

/* The 16 keys' mask of group [k0, k0 + 16) within [a, b] (inclusive; empty when b < a). */
static inline unsigned keys_in(int k0, int a, int b) {
    unsigned m = 0;
    for (int j = 0; j < 16; j++) m |= (unsigned)(k0 + j >= a && k0 + j <= b) << j;
    return m;
}

/* V of the chunk's 32-key halves [g0 / 2, (g1 + 1) / 2) as B tiles (groups outside [g0, g1): zeros). */
static TGT void pack_chunk_v(struct amx_ws *w, const struct amx_item *it, int kstart, int g0, int g1) {
    const uint16_t *vg[4] = {0};
    for (int g = g0; g < g1; g++) {
        const int pos = kstart + 16 * g;
        vg[g] = it->vc + it->head_off + ((long)it->table[pos / it->bs] * it->bs + pos % it->bs) * it->D;
    }
    for (int h = g0 / 2; h < (g1 + 1) / 2; h++) {
        const unsigned keep = keys_in(kstart + 32 * h, it->kmin, it->kmax) |
                              keys_in(kstart + 32 * h + 16, it->kmin, it->kmax) << 16;
        pack_v(w->vp + (long)h * 32 * it->D, vg + 2 * h, it->D, keep);
    }
}

/* 2^t for finite t <= AMX_RESCALE on 16 lanes: 2^n 2^f, |f| <= 1/2, 2^f by its degree-5 Taylor
 * polynomial (relative error < 3e-6: P is rounded to bf16 for the P V product anyway), 2^n by
 * vscalefps (0 far below: no clamp needed). Lanes the caller masks are zeroed by it. */
static inline TGT __m512 amx_exp2_16(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#define QK_GROUP(G, A)                                                                      \
    if (g0 <= G && G < g1) {                                                                \
        _tile_loadd(A, kg[G] + dc * 32, D * 2);                                             \
        _tile_dpbf16ps(G, A, 4);                                                            \
    }

/* S^T of row tile t over groups [g0, g1): K (straight from the cache, 16 keys a tile) times the
 * tile's Q^T, into w->s as [64 keys][16 rows]: a key's 16 row scores are one vector. */
static TGT void tile_qk(struct amx_ws *w, const struct amx_item *it, int t, int kstart, int g0, int g1) {
    const int D = it->D, nd = D / 32;
    const uint16_t *kg[4] = {0};
    for (int g = g0; g < g1; g++) {
        const int pos = kstart + 16 * g;
        kg[g] = it->kc + it->head_off + ((long)it->table[pos / it->bs] * it->bs + pos % it->bs) * D;
    }
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int dc = 0; dc < nd; dc++) {
        _tile_loadd(4, w->qt + ((long)t * nd + dc) * 512, 64);
        QK_GROUP(0, 5) QK_GROUP(1, 6) QK_GROUP(2, 7) QK_GROUP(3, 5)
    }
    if (g0 <= 0 && 0 < g1) _tile_stored(0, w->s, 64);
    if (g0 <= 1 && 1 < g1) _tile_stored(1, w->s + 256, 64);
    if (g0 <= 2 && 2 < g1) _tile_stored(2, w->s + 512, 64);
    if (g0 <= 3 && 3 < g1) _tile_stored(3, w->s + 768, 64);
}

/* The online softmax of row tile t over the chunk, its 16 rows in the lanes, in base 2 (scores
 * times scale * log2 e; the running maxima too): P (bf16, [16 rows][64 keys], zero outside the
 * rows' ranges and groups [g0, g1)), the running sums, and the factors the accumulators must be
 * scaled by (w->corr). A row's reference maximum moves only when the chunk's maximum exceeds it by
 * more than AMX_RESCALE (base 2): its P is then at most 2^AMX_RESCALE, exact enough in bf16 and
 * fp32, and most chunks leave corr = 1, so tile_pv accumulates on the tiles with no vector pass.
 * full: every real row of the tile sees every key of the groups (no masks; padding rows then get
 * scores of their zero queries, never stored). */
#define AMX_RESCALE 8.0f
static TGT void tile_softmax(struct amx_ws *w, const struct amx_item *it, int t, int kstart, int g0, int g1,
                             int h0, int h1, int full) {
    const __m512i lo = _mm512_loadu_si512(w->lo + 16 * t), hi = _mm512_loadu_si512(w->hi + 16 * t);
    const __m512 minf = _mm512_set1_ps(-INFINITY), log2e = _mm512_set1_ps(1.44269504088896341f);
    /* scores to base 2 in one multiply; soft-capped ones are rewritten in place first */
    const __m512 c = it->softcap > 0.0f ? _mm512_set1_ps(1.0f) : _mm512_mul_ps(_mm512_set1_ps(it->scale), log2e);
    __mmask16 mk[AMX_CHUNK];
    __m512 mx = minf; /* of the raw scores: c > 0, so max(s) * c is max(s * c), bit for bit */
    for (int j = 16 * g0; j < 16 * g1; j++) {
        const __m512i pos = _mm512_set1_epi32(kstart + j);
        mk[j] = full ? (__mmask16)0xFFFF
                     : _mm512_cmp_epi32_mask(pos, lo, _MM_CMPINT_NLT) & _mm512_cmp_epi32_mask(pos, hi, _MM_CMPINT_LE);
        __m512 v = _mm512_load_ps(w->s + 16 * j);
        if (it->softcap > 0.0f) {
            v = _mm512_mul_ps(ae_softcap16(_mm512_mul_ps(v, _mm512_set1_ps(it->scale)), it->softcap), log2e);
            _mm512_store_ps(w->s + 16 * j, v);
        }
        mx = full ? _mm512_max_ps(mx, v) : _mm512_mask_max_ps(mx, mk[j], mx, v);
    }
    mx = _mm512_mul_ps(mx, c);
    const __m512 mold = _mm512_loadu_ps(w->m + 16 * t);
    /* rows whose reference moves: a first key, or a maximum more than AMX_RESCALE above it */
    const __mmask16 seen = _mm512_cmp_ps_mask(mold, minf, _CMP_NEQ_OQ);
    const __mmask16 up = _mm512_cmp_ps_mask(mx, _mm512_add_ps(mold, _mm512_set1_ps(AMX_RESCALE)), _CMP_GT_OQ);
    const __m512 mref = _mm512_mask_mov_ps(mold, up, mx);
    const __mmask16 any = _mm512_cmp_ps_mask(mref, minf, _CMP_NEQ_OQ);
    const __m512 base = _mm512_maskz_mov_ps(any, mref); /* rows with no key yet: 0, not -inf - -inf */
    /* corr 1 where the reference stays, and where no key was seen (the accumulator is still 0) */
    const __m512 corr = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), up & seen, amx_exp2_16(_mm512_sub_ps(mold, mref)));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 16 * g0; j < 16 * g1; j++) {
        const __m512 x = _mm512_fmsub_ps(_mm512_load_ps(w->s + 16 * j), c, base);
        const __m512 e = full ? amx_exp2_16(x) : _mm512_maskz_mov_ps(mk[j], amx_exp2_16(x));
        sum = _mm512_add_ps(sum, e);
        _mm512_store_ps(w->s + 16 * j, e);
    }
    for (int j = 32 * h0; j < 16 * g0; j++) _mm512_store_ps(w->s + 16 * j, _mm512_setzero_ps());
    for (int j = 16 * g1; j < 32 * h1; j++) _mm512_store_ps(w->s + 16 * j, _mm512_setzero_ps());
    _mm512_storeu_ps(w->l + 16 * t, _mm512_fmadd_ps(_mm512_loadu_ps(w->l + 16 * t), corr, sum));
    _mm512_storeu_ps(w->m + 16 * t, mref);
    _mm512_storeu_ps(w->corr + 16 * t, corr);
    /* P^T -> P: keys (2i, 2i + 1) of a half, rounded and interleaved per row, are dword i of
     * every row of the A tile: a 16 x 16 dword transpose per half */
    const __m512i pair = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                          21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int h = h0; h < h1; h++) {
        __m512i x[16];
        for (int i = 0; i < 16; i++) {
            const float *a = w->s + 16 * (32 * h + 2 * i);
            x[i] = _mm512_permutexvar_epi16(pair, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(a + 16),
                                                                               _mm512_load_ps(a)));
        }
        tiles_transpose16(x);
        for (int r = 0; r < 16; r++) _mm512_storeu_si512(w->p + r * AMX_CHUNK + 32 * h, x[r]);
    }
}

#define PV_COL(C, B)                                                                        \
    if (cb + C < ncb) {                                                                     \
        _tile_loadd(B, w->vp + ((long)h * ncb + cb + C) * 512, 64);                         \
        _tile_dpbf16ps(C, 4, B);                                                            \
    }

/* acc = acc * corr + P V for row tile t over the halves [h0, h1): the rows whose reference moved
 * are rescaled in place (rare: tile_softmax), then P V accumulates onto the fp32 accumulators on
 * the tiles themselves (a 16 x 16 slice of acc is a C tile, rows D * 4 bytes apart): no vector
 * pass per chunk. A row's arithmetic is the same whatever rows share its tile. */
static TGT void tile_pv(struct amx_ws *w, const struct amx_item *it, int t, int h0, int h1) {
    const int D = it->D, ncb = D / 16;
    float *acc = w->acc + (long)16 * t * D;
    for (int r = 0; r < 16; r++) {
        const float cr = w->corr[16 * t + r];
        if (cr == 1.0f) continue;
        const __m512 c = _mm512_set1_ps(cr);
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(acc + (long)r * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + (long)r * D + d), c));
    }
    for (int cb = 0; cb < ncb; cb += 4) {
        _tile_loadd(0, acc + 16 * cb, D * 4);
        _tile_loadd(1, acc + 16 * (cb + 1), D * 4);
        if (cb + 2 < ncb) {
            _tile_loadd(2, acc + 16 * (cb + 2), D * 4);
            _tile_loadd(3, acc + 16 * (cb + 3), D * 4);
        }
        for (int h = h0; h < h1; h++) {
            _tile_loadd(4, w->p + 32 * h, AMX_CHUNK * 2);
            PV_COL(0, 5) PV_COL(1, 6) PV_COL(2, 7) PV_COL(3, 5)
        }
        _tile_stored(0, acc + 16 * cb, D * 4);
        _tile_stored(1, acc + 16 * (cb + 1), D * 4);
        if (cb + 2 < ncb) {
            _tile_stored(2, acc + 16 * (cb + 2), D * 4);
            _tile_stored(3, acc + 16 * (cb + 3), D * 4);
        }
    }
}

/* The K and V of chunk ch's blocks into L2, AMX_PREFETCH chunks ahead of their use: a decoding
 * item streams its cache from memory, blocks scattered (no hardware prefetcher follows them). */
#define AMX_PREFETCH 2
static inline TGT void prefetch_chunk(const struct amx_item *it, int ch) {
    const int first = ch * AMX_CHUNK > it->kmin ? ch * AMX_CHUNK : it->kmin;
    const int last = ch * AMX_CHUNK + AMX_CHUNK - 1 < it->kmax ? ch * AMX_CHUNK + AMX_CHUNK - 1 : it->kmax;
    for (int pos = first & ~15; pos <= last; pos += 16) {
        const long off = it->head_off + ((long)it->table[pos / it->bs] * it->bs + pos % it->bs) * it->D;
        for (int b = 0; b < 16 * it->D * 2; b += 64) {
            _mm_prefetch((const char *)(it->kc + off) + b, _MM_HINT_T1);
            _mm_prefetch((const char *)(it->vc + off) + b, _MM_HINT_T1);
        }
    }
}

/* One item: its rows' outputs over keys [kmin, kmax], chunk by chunk. */
static TGT void amx_item_run(struct amx_ws *w, const struct amx_item *it) {
    const int ntiles = (it->nr + 15) / 16;
    for (int ch = it->kmin / AMX_CHUNK; ch <= it->kmax / AMX_CHUNK; ch++) {
        const int kstart = ch * AMX_CHUNK;
        if (ch == it->kmin / AMX_CHUNK)
            for (int c = ch + 1; c < ch + AMX_PREFETCH && c <= it->kmax / AMX_CHUNK; c++) prefetch_chunk(it, c);
        if (ch + AMX_PREFETCH <= it->kmax / AMX_CHUNK) prefetch_chunk(it, ch + AMX_PREFETCH);
        const int a = it->kmin > kstart ? it->kmin - kstart : 0;
        const int b = it->kmax < kstart + AMX_CHUNK - 1 ? it->kmax - kstart : AMX_CHUNK - 1;
        const int g0 = a / 16, g1 = b / 16 + 1, h0 = g0 / 2, h1 = (g1 + 1) / 2;
        pack_chunk_v(w, it, kstart, g0, g1);
        for (int t = 0; t < ntiles; t++) {
            int tlo = 1 << 30, thi = -1, lo_max = -1, hi_min = 1 << 30;
            for (int r = 16 * t; r < 16 * t + 16 && r < it->nr; r++) {
                tlo = w->lo[r] < tlo ? w->lo[r] : tlo;
                thi = w->hi[r] > thi ? w->hi[r] : thi;
                lo_max = w->lo[r] > lo_max ? w->lo[r] : lo_max;
                hi_min = w->hi[r] < hi_min ? w->hi[r] : hi_min;
            }
            if (thi < kstart || tlo > kstart + AMX_CHUNK - 1) continue; /* no row of this tile sees the chunk */
            tile_qk(w, it, t, kstart, g0, g1);
            const int full = lo_max <= kstart + 16 * g0 && kstart + 16 * g1 - 1 <= hi_min;
            tile_softmax(w, it, t, kstart, g0, g1, h0, h1, full);
            tile_pv(w, it, t, h0, h1);
        }
    }
}

/* Item it of sequence s: load its rows (q as stored, zero padded to whole tiles), attend, store. */
static TGT void amx_item(struct amx_ws *w, const uint16_t *q, long q_stride, uint16_t *out, const uint16_t *kc,
                         const uint16_t *vc, const int32_t *table, int qstart, int ctx, int h, int r0, int r1, int g,
                         int Hkv, int NB, int bs, int D, float scale, int window, float softcap) {
    struct amx_item it = {kc, vc, table, (long)h * NB * bs * D, r1 - r0, D, bs, 1 << 30, -1, scale, softcap};
    const int Hq = Hkv * g;
    for (int r = 0; r < it.nr; r++) {
        const int row = r0 + r, i = row / g, head = h * g + row % g;
        memcpy(w->q + (long)r * D, q + (long)(qstart + i) * q_stride + (long)head * D, sizeof(uint16_t) * D);
        w->hi[r] = ctx + i;
        w->lo[r] = window > 0 && ctx + i - window + 1 > 0 ? ctx + i - window + 1 : 0;
        w->m[r] = -INFINITY, w->l[r] = 0.0f;
        memset(w->acc + (long)r * D, 0, sizeof(float) * D);
        it.kmin = w->lo[r] < it.kmin ? w->lo[r] : it.kmin;
        it.kmax = w->hi[r] > it.kmax ? w->hi[r] : it.kmax;
    }
    const int padded = (it.nr + 15) / 16 * 16;
    memset(w->q + (long)it.nr * D, 0, sizeof(uint16_t) * D * (padded - it.nr));
    for (int r = it.nr; r < padded; r++) w->lo[r] = 1 << 30, w->hi[r] = -1, w->m[r] = -INFINITY, w->l[r] = 0.0f;
    memset(w->acc + (long)it.nr * D, 0, sizeof(float) * D * (padded - it.nr));
    for (int t = 0; t < padded / 16; t++) pack_kt(w->qt + (long)t * 16 * D, w->q + (long)t * 16 * D, D, 0xFFFF);
    amx_item_run(w, &it);
    for (int r = 0; r < it.nr; r++) {
        const int row = r0 + r, i = row / g, head = h * g + row % g;
        const __m512 inv = _mm512_set1_ps(w->l[r] > 0.0f ? 1.0f / w->l[r] : 0.0f);
        uint16_t *dst = out + ((long)(qstart + i) * Hq + head) * D;
        for (int d = 0; d < D; d += 16)
            ae_st_bf16x16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(w->acc + (long)r * D + d), inv));
    }
}

/* The sequence s with first[s] <= i < first[s + 1] (as attention.c's attn_owner). */
static inline int amx_owner(const long *first, int n, long i) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}

void *ae_attn_paged_amx(const void *q, long q_stride, void *out, const void *k_cache, const void *v_cache,
                        const int32_t *block_ids, const int32_t *block_starts, const int32_t *query_starts,
                        const int32_t *query_lens, const int32_t *context_lens, int num_seqs, int Hq, int Hkv,
                        int D, int NB, int bs, float scale, int window, float softcap, int parallel,
                        const int32_t **rest_out) {
    const int g = Hq / Hkv;
    long *first = (long *)malloc(sizeof(long) * ((size_t)num_seqs + 1) + sizeof(int32_t) * (size_t)num_seqs);
    if (!first) {
        fprintf(stderr, "asyncengine: out of memory in paged attention (%d sequences)\n", num_seqs);
        abort();
    }
    int32_t *rest = (int32_t *)(first + num_seqs + 1); /* the lengths left to the caller's loops */
    first[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int take = query_lens[s] * g >= AMX_MIN_ROWS;
        rest[s] = take ? 0 : query_lens[s];
        first[s + 1] = first[s] + (take ? (long)((query_lens[s] * g + AMX_ROWS - 1) / AMX_ROWS) * Hkv : 0);
    }
    const long total = first[num_seqs];
    *rest_out = (const int32_t *)rest;
    if (total == 0) return first;
#pragma omp parallel if (parallel)
    {
        struct amx_ws *w = (struct amx_ws *)aligned_alloc(64, sizeof(struct amx_ws));
        if (!w) {
            fprintf(stderr, "asyncengine: out of memory in paged attention (work space)\n");
            abort();
        }
        amx_config();
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < total; item++) {
            const int s = amx_owner(first, num_seqs, item);
            const int tiles = (query_lens[s] * g + AMX_ROWS - 1) / AMX_ROWS;
            const long rem = item - first[s];
            const int h = (int)(rem / tiles), t = (int)(rem % tiles), rows = query_lens[s] * g;
            const int r0 = t * AMX_ROWS, r1 = r0 + AMX_ROWS < rows ? r0 + AMX_ROWS : rows;
            amx_item(w, (const uint16_t *)q, q_stride, (uint16_t *)out, (const uint16_t *)k_cache,
                     (const uint16_t *)v_cache, block_ids + block_starts[s], query_starts[s], context_lens[s], h, r0,
                     r1, g, Hkv, NB, bs, D, scale, window, softcap);
        }
        _tile_release();
        free(w);
    }
    return first;
}

#else /* no x86: never called (isa.c never grants the level) */
void *ae_attn_paged_amx(const void *q, long q_stride, void *out, const void *k_cache, const void *v_cache,
                        const int32_t *block_ids, const int32_t *block_starts, const int32_t *query_starts,
                        const int32_t *query_lens, const int32_t *context_lens, int num_seqs, int Hq, int Hkv,
                        int D, int NB, int bs, float scale, int window, float softcap, int parallel,
                        const int32_t **rest_out) {
    (void)q, (void)q_stride, (void)out, (void)k_cache, (void)v_cache, (void)block_ids, (void)block_starts;
    (void)query_starts, (void)query_lens, (void)context_lens, (void)num_seqs, (void)Hq, (void)Hkv, (void)D;
    (void)NB, (void)bs, (void)scale, (void)window, (void)softcap, (void)parallel, (void)rest_out;
    abort();
}
#endif
