/* Paged attention as AMX-BF16 tile products, for bf16 caches (isa.c level AE_ISA_AMX_BF16, which
 * the OS has granted this process): the per-row loops of attention.c / attention_avx512.c compute
 * one query row's dot products key by key; here a block of up to 64 query rows of one (sequence,
 * kv head) meets a chunk of 64 keys in two products, S = Q K^T and O = P V, on 16 x 16 tiles.
 *
 * Work items are (sequence, kv head, block of AMX_ROWS rows); rows are (query token, head of the
 * kv head's group), so a decoding sequence's grouped heads share one product (GQA packing) and a
 * prefill's rows come 16 tokens x 4 heads at a time. Per 64-key chunk (positions 64c .. 64c + 63,
 * whatever the block size), K^T and V are packed once (attention_tiles.h) for the item's 16-row
 * tiles; each tile: S on AMX (fp32 sums of exact bf16 products; the scale applied after, as the
 * vdpbf16ps loop), the online softmax in fp32 on AVX-512, P rounded to bf16 for the P V product
 * (as vLLM's and SGLang's CPU kernels do), P V into fp32 tiles, added to fp32 accumulators.
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
#define AMX_ROWS 64  /* query rows per item: 4 tiles of 16 share each chunk's packed K and V */
#define AMX_CHUNK 64 /* keys per online-softmax step: 4 groups of 16 */
#define AMX_MAX_D 256

struct amx_ws { /* one thread's work space (64-byte aligned: tiles and packs are stored whole) */
    uint16_t q[AMX_ROWS * AMX_MAX_D];   /* the item's query rows, bf16 as stored, zero padded */
    uint16_t kt[AMX_CHUNK * AMX_MAX_D]; /* K^T tiles: [group of 16 keys][dim slice of 32] */
    uint16_t vp[AMX_CHUNK * AMX_MAX_D]; /* V tiles: [32-key half][dim slice of 16] */
    float s[16 * AMX_CHUNK];            /* one row tile's scores */
    uint16_t p[16 * AMX_CHUNK];         /* its probabilities, bf16 */
    float o[16 * 64];                   /* its P V over 64 dims */
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

/* K^T and V of the chunk's groups [g0, g1) (others packed as zeros where a 32-key half needs them). */
static TGT void pack_chunk(struct amx_ws *w, const struct amx_item *it, int kstart, int g0, int g1) {
    const uint16_t *kg[4] = {0}, *vg[4] = {0};
    for (int g = g0; g < g1; g++) {
        const int pos = kstart + 16 * g;
        const long off = it->head_off + ((long)it->table[pos / it->bs] * it->bs + pos % it->bs) * it->D;
        kg[g] = it->kc + off, vg[g] = it->vc + off;
        pack_kt(w->kt + (long)g * 16 * it->D, kg[g], it->D, keys_in(pos, it->kmin, it->kmax));
    }
    for (int h = g0 / 2; h < (g1 + 1) / 2; h++) {
        const unsigned keep = keys_in(kstart + 32 * h, it->kmin, it->kmax) |
                              keys_in(kstart + 32 * h + 16, it->kmin, it->kmax) << 16;
        pack_v(w->vp + (long)h * 32 * it->D, vg + 2 * h, it->D, keep);
    }
}

#define QK_GROUP(G, B)                                                                      \
    if (g0 <= G && G < g1) {                                                                \
        _tile_loadd(B, w->kt + ((long)G * nd + dc) * 512, 64);                              \
        _tile_dpbf16ps(G, 4, B);                                                            \
    }

/* S of row tile t (rows 16t .. 16t + 15) over groups [g0, g1), into w->s (16 rows x 64 keys). */
static TGT void tile_qk(struct amx_ws *w, int t, int D, int g0, int g1) {
    const int nd = D / 32;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int dc = 0; dc < nd; dc++) {
        _tile_loadd(4, w->q + (long)t * 16 * D + dc * 32, D * 2);
        QK_GROUP(0, 5) QK_GROUP(1, 6) QK_GROUP(2, 7) QK_GROUP(3, 5)
    }
    if (g0 <= 0 && 0 < g1) _tile_stored(0, w->s, 256);
    if (g0 <= 1 && 1 < g1) _tile_stored(1, w->s + 16, 256);
    if (g0 <= 2 && 2 < g1) _tile_stored(2, w->s + 32, 256);
    if (g0 <= 3 && 3 < g1) _tile_stored(3, w->s + 48, 256);
}

/* The online softmax of one row's scores in the chunk: P (bf16) over the halves [h0, h1), its
 * running max / sum, and the factor its accumulator must be scaled by. */
static TGT void row_softmax(struct amx_ws *w, const struct amx_item *it, int rt, int row, int kstart, int g0,
                            int g1, int h0, int h1) {
    float *s = w->s + rt * AMX_CHUNK;
    uint16_t *p = w->p + rt * AMX_CHUNK;
    memset(p + 32 * h0, 0, sizeof(uint16_t) * 32 * (h1 - h0));
    w->corr[row] = 1.0f;
    if (row >= it->nr) return; /* a padding row of the last tile */
    int j0 = w->lo[row] - kstart, j1 = w->hi[row] - kstart + 1;
    j0 = j0 < 0 ? 0 : j0;
    j1 = j1 > AMX_CHUNK ? AMX_CHUNK : j1;
    if (j0 >= j1) return;
    __mmask16 mk[4];
    __m512 mxv = _mm512_set1_ps(-INFINITY);
    for (int g = g0; g < g1; g++) {
        const int a = j0 > 16 * g ? j0 - 16 * g : 0, e = j1 - 16 * g < 16 ? j1 - 16 * g : 16;
        mk[g] = a < e ? (__mmask16)(((1u << e) - 1u) & ~((1u << a) - 1u)) : 0;
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * g), _mm512_set1_ps(it->scale));
        if (it->softcap > 0.0f) v = ae_softcap16(v, it->softcap);
        v = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mk[g], v);
        _mm512_storeu_ps(s + 16 * g, v);
        mxv = _mm512_max_ps(mxv, v);
    }
    const float mx = _mm512_reduce_max_ps(mxv), mold = w->m[row];
    const float mnew = mx > mold ? mx : mold;
    w->corr[row] = mold == -INFINITY ? 0.0f : expf(mold - mnew);
    __m512 sum = _mm512_setzero_ps(), mv = _mm512_set1_ps(mnew);
    for (int g = g0; g < g1; g++) {
        __m512 e = _mm512_maskz_mov_ps(mk[g], ae_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * g), mv)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(p + 16 * g), (__m256i)_mm512_cvtneps_pbh(e));
    }
    w->l[row] = w->l[row] * w->corr[row] + _mm512_reduce_add_ps(sum);
    w->m[row] = mnew;
}

#define PV_COL(C, B)                                                                        \
    if (cb + C < ncb) {                                                                     \
        _tile_loadd(B, w->vp + ((long)h * ncb + cb + C) * 512, 64);                         \
        _tile_dpbf16ps(C, 4, B);                                                            \
    }

/* acc = acc * corr + P V for row tile t over the halves [h0, h1). */
static TGT void tile_pv(struct amx_ws *w, const struct amx_item *it, int t, int h0, int h1) {
    const int D = it->D, ncb = D / 16;
    const int rows = it->nr - 16 * t < 16 ? it->nr - 16 * t : 16;
    for (int cb = 0; cb < ncb; cb += 4) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int h = h0; h < h1; h++) {
            _tile_loadd(4, w->p + 32 * h, AMX_CHUNK * 2);
            PV_COL(0, 5) PV_COL(1, 6) PV_COL(2, 7) PV_COL(3, 5)
        }
        _tile_stored(0, w->o, 256);
        _tile_stored(1, w->o + 16, 256);
        if (cb + 2 < ncb) {
            _tile_stored(2, w->o + 32, 256);
            _tile_stored(3, w->o + 48, 256);
        }
        const int nv = ncb - cb < 4 ? ncb - cb : 4;
        for (int r = 0; r < rows; r++) {
            float *a = w->acc + (long)(16 * t + r) * D + 16 * cb;
            const __m512 c = _mm512_set1_ps(w->corr[16 * t + r]);
            for (int v = 0; v < nv; v++)
                _mm512_storeu_ps(a + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * v), c,
                                                             _mm512_loadu_ps(w->o + r * 64 + 16 * v)));
        }
    }
}

/* One item: its rows' outputs over keys [kmin, kmax], chunk by chunk. */
static TGT void amx_item_run(struct amx_ws *w, const struct amx_item *it) {
    const int ntiles = (it->nr + 15) / 16;
    for (int ch = it->kmin / AMX_CHUNK; ch <= it->kmax / AMX_CHUNK; ch++) {
        const int kstart = ch * AMX_CHUNK;
        const int a = it->kmin > kstart ? it->kmin - kstart : 0;
        const int b = it->kmax < kstart + AMX_CHUNK - 1 ? it->kmax - kstart : AMX_CHUNK - 1;
        const int g0 = a / 16, g1 = b / 16 + 1, h0 = g0 / 2, h1 = (g1 + 1) / 2;
        pack_chunk(w, it, kstart, g0, g1);
        for (int t = 0; t < ntiles; t++) {
            int tlo = 1 << 30, thi = -1;
            for (int r = 16 * t; r < 16 * t + 16 && r < it->nr; r++) {
                tlo = w->lo[r] < tlo ? w->lo[r] : tlo;
                thi = w->hi[r] > thi ? w->hi[r] : thi;
            }
            if (thi < kstart || tlo > kstart + AMX_CHUNK - 1) continue; /* no row of this tile sees the chunk */
            tile_qk(w, t, it->D, g0, g1);
            for (int r = 0; r < 16; r++) row_softmax(w, it, r, 16 * t + r, kstart, g0, g1, h0, h1);
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

void ae_attn_paged_amx(const void *q, long q_stride, void *out, const void *k_cache, const void *v_cache,
                       const int32_t *block_ids, const int32_t *block_starts, const int32_t *query_starts,
                       const int32_t *query_lens, const int32_t *context_lens, int num_seqs, int Hq, int Hkv,
                       int D, int NB, int bs, float scale, int window, float softcap, int parallel) {
    const int g = Hq / Hkv;
    long *first = (long *)malloc(sizeof(long) * ((size_t)num_seqs + 1));
    if (!first) {
        fprintf(stderr, "asyncengine: out of memory in paged attention (%d sequences)\n", num_seqs);
        abort();
    }
    first[0] = 0;
    for (int s = 0; s < num_seqs; s++)
        first[s + 1] = first[s] + (long)((query_lens[s] * g + AMX_ROWS - 1) / AMX_ROWS) * Hkv;
    const long total = first[num_seqs];
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
    free(first);
}

#else /* no x86: never called (isa.c never grants the level) */
void ae_attn_paged_amx(const void *q, long q_stride, void *out, const void *k_cache, const void *v_cache,
                       const int32_t *block_ids, const int32_t *block_starts, const int32_t *query_starts,
                       const int32_t *query_lens, const int32_t *context_lens, int num_seqs, int Hq, int Hkv,
                       int D, int NB, int bs, float scale, int window, float softcap, int parallel) {
    (void)q, (void)q_stride, (void)out, (void)k_cache, (void)v_cache, (void)block_ids, (void)block_starts;
    (void)query_starts, (void)query_lens, (void)context_lens, (void)num_seqs, (void)Hq, (void)Hkv, (void)D;
    (void)NB, (void)bs, (void)scale, (void)window, (void)softcap, (void)parallel;
    abort();
}
#endif
