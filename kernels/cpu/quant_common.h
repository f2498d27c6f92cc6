/* What the quantized-matmul files share (quant.c: fp32 activations, dequantize, embedding;
 * quant_i8.c: int8 activations; quant_x8.c: the repacked layout): the GGUF block formats, fp16,
 * and where block b of row n lies in either layout.
 *
 * Two layouts of a weight W [N, K]:
 *   rows (the file's): row n is K/32 blocks of
 *     Q8_0: fp16 d, int8 q[32]              -> w = d * q                  (34 bytes)
 *     Q4_0: fp16 d, u8 qs[16]               -> w = d * (q - 8)            (18 bytes)
 *     Q4_1: fp16 d, fp16 m, u8 qs[16]       -> w = d * q + m              (20 bytes)
 *   (Q4: element j < 16 is the low nibble of qs[j], element 16 + j its high nibble.)
 *
 *   x8 (repacked at load, quant_x8.c; the type id carries AE_Q_X8): rows 8g..8g+7 occupy the same
 *   8 * row_bytes bytes as in the file, block by block: block b of the group is 8 * block_bytes:
 *     d[8] fp16, (Q4_1) m[8] fp16, then the quants in 8-byte chunks, chunk c of row r at 64 c + 8 r
 *     (Q4: chunk 0 = qs[0..7], chunk 1 = qs[8..15]; Q8_0: chunk c = q[8c..8c+7]).
 *   Why: one 64-byte load is the same 8 elements of 8 rows, so one vpdpbusd against an activation
 *   chunk broadcast to every 64-bit lane makes 8 rows' partial dot products, and the 8 rows' scales
 *   are one 16-byte load: no gathers, no 8x8 transpose per block (quant_x8.h).
 */
#ifndef AE_QUANT_COMMON_H
#define AE_QUANT_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

enum { AE_Q_Q4_0 = 2, AE_Q_Q4_1 = 3, AE_Q_Q8_0 = 8, AE_Q_Q4_K = 12, AE_Q_Q5_K = 13, AE_Q_Q6_K = 14 }; /* GGML ids */
#define AE_Q_X8 0x100  /* flag on a type id: the weight is in the x8 layout (above) */
#define AE_Q_CHUNK 16  /* rows of W per scheduling unit (two x8 groups) */

/* Every (format, layout) a GEMM dispatches on, as CASE(type, x8 flag): a switch over them hands
 * each chunk loop its format as a constant, so the compiler specialises it (one list for every
 * dispatch site). */
#define AE_Q_FOR_EACH_FORMAT(CASE) \
    CASE(AE_Q_Q4_0, 0) CASE(AE_Q_Q4_1, 0) CASE(AE_Q_Q8_0, 0) \
    CASE(AE_Q_Q4_0, AE_Q_X8) CASE(AE_Q_Q4_1, AE_Q_X8) CASE(AE_Q_Q8_0, AE_Q_X8) \
    CASE(AE_Q_Q4_K, 0) CASE(AE_Q_Q5_K, 0) CASE(AE_Q_Q6_K, 0)

/* The K-quant super-block formats (quant_k.h): 256 values per block, the file's row layout only. */
static inline int is_kquant(int type) {
    return type == AE_Q_Q4_K || type == AE_Q_Q5_K || type == AE_Q_Q6_K;
}

static inline float fp16_to_fp32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Bytes per block (of 32 values; of 256 for the K-quants, see block_len). */
static inline int block_bytes(int type) {
    switch (type) {
        case AE_Q_Q8_0: return 34;
        case AE_Q_Q4_1: return 20;
        case AE_Q_Q4_0: return 18;
        case AE_Q_Q4_K: return 144;
        case AE_Q_Q5_K: return 176;
        case AE_Q_Q6_K: return 210;
        default: return 0;
    }
}

/* Values per block: 32, or 256 for the K-quants. */
static inline int block_len(int type) {
    return is_kquant(type) ? 256 : 32;
}

/* Where row n's blocks lie: block b starts at base + b * step; in it d at +d, m at +m (Q4_1), the
 * 8-byte quant chunks at +q, +q + qstep, ... */
typedef struct {
    const uint8_t *base;
    int64_t step;
    int d, m, q, qstep;
} ae_qrow;

static inline __attribute__((always_inline)) ae_qrow qrow(int type, int x8, const uint8_t *w, int64_t row_bytes,
                                                          int64_t n) {
    const int bs = block_bytes(type), hdr = type == AE_Q_Q4_1 ? 4 : 2;
    ae_qrow r;
    if (!x8) {
        r.base = w + n * row_bytes;
        r.step = bs;
        r.d = 0, r.m = 2, r.q = hdr, r.qstep = 8;
    } else {
        const int i = (int)(n & 7);
        r.base = w + (n >> 3) * 8 * row_bytes;
        r.step = 8 * bs;
        r.d = 2 * i, r.m = 16 + 2 * i, r.q = 8 * hdr + 8 * i, r.qstep = 64;
    }
    return r;
}

/* d, the additive term m (Q4_0: -8 d; Q8_0: 0) and the 32 quants of row r's block b, as floats. */
static inline void qrow_block(int type, const ae_qrow *r, int64_t b, float *d, float *m, float q[32]) {
    const uint8_t *blk = r->base + b * r->step;
    *d = fp16_to_fp32(blk + r->d);
    if (type == AE_Q_Q8_0) {
        *m = 0.0f;
        for (int c = 0; c < 4; c++)
            for (int j = 0; j < 8; j++) q[8 * c + j] = (float)(int8_t)blk[r->q + c * r->qstep + j];
        return;
    }
    *m = type == AE_Q_Q4_1 ? fp16_to_fp32(blk + r->m) : -8.0f * *d;
    for (int c = 0; c < 2; c++)
        for (int j = 0; j < 8; j++) {
            const uint8_t v = blk[r->q + c * r->qstep + j];
            q[8 * c + j] = (float)(v & 0x0F);
            q[16 + 8 * c + j] = (float)(v >> 4);
        }
}

#endif /* AE_QUANT_COMMON_H */
