/* The operand layouts of attention_amx.c's tile products. An AMX-BF16 product C[16 x 16] +=
 * A[16 x 32] B[32 x 16] takes B "pair-interleaved": row i of the B tile holds, for each of its 16
 * columns n, the two bf16 values B[2i][n], B[2i + 1][n]. So
 *   S^T = K Q^T needs Q^T that way: row i = dims (2i, 2i + 1) of 16 query rows, a 16 x 16
 *         transpose of 32-bit pairs (pack_kt: of any 16 rows; K itself is the A operand, as stored);
 *   O = P V     needs V that way: row i = keys (2i, 2i + 1) of 16 dims interleaved (pack_v).
 * Q^T is packed once per item, V once per 64-key chunk and shared by every 16-row tile of the
 * item's queries. Keys outside [kmin, kmax] are packed as zeros (never read): a stale slot past the
 * sequence's end could hold a NaN, and 0 * NaN is NaN.
 */
#ifndef AE_ATTENTION_TILES_H
#define AE_ATTENTION_TILES_H

#include <stdint.h>

#include "simd.h"

#if AE_X86

#define TILES_TGT AE_TGT_AMX

/* 16 rows of 16 32-bit lanes, transposed in registers (unpack 32, unpack 64, two lane shuffles). */
static inline TILES_TGT __attribute__((always_inline)) void tiles_transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* u[4i + c], 128-bit lane L: rows 4i..4i+3 of column 4L + c */
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
        r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
}

/* The 16 rows at k (rows of D bf16; those whose bits are clear in keep read as zeros) -> D / 32 B
 * tiles of their transpose at dst (512 bf16 each, dim slice by dim slice). */
static inline TILES_TGT __attribute__((always_inline)) void pack_kt(uint16_t *dst, const uint16_t *k, int D,
                                                                    unsigned keep) {
    for (int dc = 0; dc < D / 32; dc++) {
        __m512i r[16];
        for (int j = 0; j < 16; j++)
            r[j] = _mm512_maskz_loadu_epi32((__mmask16)((keep >> j) & 1 ? 0xFFFF : 0), k + (long)j * D + dc * 32);
        tiles_transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_store_si512(dst + dc * 512 + j * 32, r[j]);
    }
}

/* 32 keys (key j at g[j >> 4] + (j & 15) * D; bits of keep: which are real) -> the D / 16 B tiles
 * of V at dst (512 bf16 each, 16 dims a tile). A NULL group is all zeros. */
static inline TILES_TGT __attribute__((always_inline)) void pack_v(uint16_t *dst, const uint16_t *const g[2], int D,
                                                                   uint32_t keep) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int i = 0; i < 16; i++) {
        const int a = 2 * i, b = 2 * i + 1;
        const uint16_t *ra = g[a >> 4] ? g[a >> 4] + (long)(a & 15) * D : NULL;
        const uint16_t *rb = g[b >> 4] ? g[b >> 4] + (long)(b & 15) * D : NULL;
        const __mmask32 ma = ra && ((keep >> a) & 1) ? 0xFFFFFFFFu : 0, mb = rb && ((keep >> b) & 1) ? 0xFFFFFFFFu : 0;
        for (int dc = 0; dc < D / 32; dc++) {
            __m512i x = ma ? _mm512_loadu_si512(ra + dc * 32) : _mm512_setzero_si512();
            __m512i y = mb ? _mm512_loadu_si512(rb + dc * 32) : _mm512_setzero_si512();
            _mm512_store_si512(dst + (2 * dc) * 512 + i * 32, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_store_si512(dst + (2 * dc + 1) * 512 + i * 32, _mm512_permutex2var_epi16(x, hi, y));
        }
    }
}

#endif /* AE_X86 */
#endif /* AE_ATTENTION_TILES_H */
