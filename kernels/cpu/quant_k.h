/* The K-quant super-block formats (Q4_K, Q5_K, Q6_K: 256 values per block, llama.cpp's k-quants),
 * kept in the file's row layout, and what every kernel on them shares: the decoding of one
 * super-block into small integers with their integer scales (portable C; the SIMD copies of
 * quant_k_isa.h decode the same integers with vector ops), its dequantization, and the float
 * work per super-block, which is the same scalar code on every ISA (so results are bit-identical:
 * the integer dot products are exact on every path, and the floats that combine them are these).
 *
 *   Q4_K (144 bytes): fp16 d, fp16 dmin, u8 scales[12] (8 x 6-bit scale sc, 8 x 6-bit min m),
 *         u8 qs[128]: sub-block j (32 values) = d * sc_j * q - dmin * m_j, q in 0..15
 *         (64-value group g: qs[32 g .. 32 g + 31], low nibbles = sub-block 2g, high = 2g + 1)
 *   Q5_K (176 bytes): as Q4_K plus u8 qh[32] (before qs): bit j of qh[l] is bit 4 of value l of
 *         sub-block j; q in 0..31
 *   Q6_K (210 bytes): u8 ql[128], u8 qh[64], s8 scales[16], fp16 d: 16 values share a scale:
 *         w = d * sc * (q - 32), q in 0..63 (low 4 bits from ql, high 2 from qh)
 *
 * Activations (llama.cpp's q8_K): blocks of 256, dx = max|x| / 127, q = rint(x / dx); per-32 sums
 * of q for the Q4_K/Q5_K min term. Per (weight super-block, activation block):
 *   Q4_K/Q5_K: dot = dx * d * sum_j sc_j * (q_w . q_x)_j - dx * dmin * sum_j m_j * sum(q_x)_j
 *   Q6_K:      dot = dx * d * sum_k sc_k * ((q_w - 32) . q_x)_k        (k: 16 sub-blocks of 16)
 */
#ifndef AE_QUANT_K_H
#define AE_QUANT_K_H

#include <math.h>
#include <stdint.h>

#include "quant_common.h"

#define AE_QK 256 /* values per K-quant super-block (and per activation block of the K kernels) */

/* Q4_K/Q5_K: the 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4). */
static inline void k4_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K/Q5_K: all 8 scales and mins of a super-block at once (the 12 bytes as 3 words; llama.cpp's
 * utmp trick: a dozen integer ops instead of 8 k4_scale_min calls). Same values as k4_scale_min. */
static inline void k4_scales(const uint8_t *q, uint8_t sc[8], uint8_t m[8]) {
    uint32_t u[3], o[4];
    memcpy(u, q, 12);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    o[0] = u[0] & k1;
    o[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    o[2] = u[1] & k1;
    o[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    memcpy(sc, o, 8);
    memcpy(m, o + 2, 8);
}

/* One super-block as integers in element order: q[256] (Q4_K/Q5_K: 0..31 unsigned; Q6_K: q - 32,
 * -32..31), sc[] (8 per 32 values; Q6_K: 16 per 16 values), m[8] (Q4_K/Q5_K), d and dmin. */
static inline void k_decode(int type, const uint8_t *blk, int8_t q[AE_QK], int sc[16], int m[8], float *d,
                            float *dmin) {
    if (type == AE_Q_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *s = (const int8_t *)(blk + 192);
        *d = fp16_to_fp32(blk + 208), *dmin = 0.0f;
        for (int k = 0; k < 16; k++) sc[k] = s[k];
        for (int h = 0; h < 2; h++, ql += 64, qh += 32)
            for (int l = 0; l < 32; l++) {
                int8_t *o = q + 128 * h + l;
                o[0] = (int8_t)(((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32);
                o[32] = (int8_t)(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
                o[64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                o[96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        return;
    }
    *d = fp16_to_fp32(blk), *dmin = fp16_to_fp32(blk + 2);
    for (int j = 0; j < 8; j++) k4_scale_min(j, blk + 4, sc + j, m + j);
    const uint8_t *qh = blk + 16, *qs = blk + (type == AE_Q_Q5_K ? 48 : 16);
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l++) {
            const uint8_t v = qs[32 * g + l];
            int lo = v & 0x0F, hi = v >> 4;
            if (type == AE_Q_Q5_K) {
                lo |= ((qh[l] >> (2 * g)) & 1) << 4;
                hi |= ((qh[l] >> (2 * g + 1)) & 1) << 4;
            }
            q[64 * g + l] = (int8_t)lo;
            q[64 * g + 32 + l] = (int8_t)hi;
        }
}

/* One super-block dequantized as llama.cpp does it (d * sc * q - dmin * m; d * sc * (q - 32)). */
static inline void k_dequant_block(int type, const uint8_t *blk, float *out) {
    int8_t q[AE_QK];
    int sc[16], m[8];
    float d, dmin;
    k_decode(type, blk, q, sc, m, &d, &dmin);
    if (type == AE_Q_Q6_K) {
        for (int i = 0; i < AE_QK; i++) out[i] = d * (float)sc[i / 16] * (float)q[i];
        return;
    }
    for (int j = 0; j < 8; j++) {
        const float dl = d * (float)sc[j], ml = dmin * (float)m[j];
        for (int l = 0; l < 32; l++) out[32 * j + l] = dl * (float)q[32 * j + l] - ml;
    }
}

/* acc + one (super-block, activation block) pair's contribution, from its exact integer sums:
 * the float work every ISA shares (sumi = sum sc * dot; summ = sum m * xsum, 0 for Q6_K). */
static inline float k_combine(const uint8_t *blk, int type, float dx, int32_t sumi, int32_t summ, float acc) {
    if (type == AE_Q_Q6_K) return fmaf(dx * fp16_to_fp32(blk + 208), (float)sumi, acc);
    acc = fmaf(dx * fp16_to_fp32(blk), (float)sumi, acc);
    return fmaf(-(dx * fp16_to_fp32(blk + 2)), (float)summ, acc);
}

/* Row-major [M, K] fp32 -> q [M, K] int8 and d [M, K / 256]: q8_K blocks (the per-32 sums of q
 * the min term needs are gemm_i8's xsum). The rounding is rint (ties to even) of x * (1 / d) in
 * fp32, as quant_i8.c's blocks of 32. */
static inline void k_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *q, float *d) {
    for (int64_t i = 0; i < M * (K / AE_QK); i++) {
        const float *xp = x + i * AE_QK;
        float amax = 0.0f;
        for (int j = 0; j < AE_QK; j++) amax = fmaxf(amax, fabsf(xp[j]));
        const float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
        for (int j = 0; j < AE_QK; j++) q[i * AE_QK + j] = (int8_t)lrintf(xp[j] * id);
        d[i] = dd;
    }
}

#endif /* AE_QUANT_K_H */
