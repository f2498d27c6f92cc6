/* The 8-bit KV cache (attention_i8.c): layout, quantization of one row, and what its per-ISA item
 * loops (attention_i8_item.h) are handed.
 *
 * Layout: per layer, k and v each int8 [Hkv, NB, bs, D + 2]: a token's row of one KV head is D int8
 * values then its scale, an IEEE half (2 bytes, little-endian), so a row is x ~ q * scale with
 * scale = max|x| / 127 (symmetric, llama.cpp's q8_0 rounding rule applied to the whole head row:
 * one scale per token per KV head). Rows stay whole under the block dim, so anything that copies
 * blocks (prefix cache, offload tier, P/D transfers) carries the scales with the values.
 */
#ifndef AE_ATTENTION_I8_H
#define AE_ATTENTION_I8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention_rows.h"

#define AE_I8_TILE 16 /* keys dequantized at once (into L1) and shared by every row of an item */

static inline float i8_half_load(const int8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* Quantize one row of D fp32 values to D int8 and a half scale (dst: D + 2 bytes). Rounding: x * 127
 * / max|x| to nearest even (torch.round), the scale rounded to half to nearest even: the torch
 * reference (kernels/cpu/attention_i8.py) computes the same bits. */
static inline void i8_quantize_row(const float *x, int D, int8_t *dst) {
    float amax = 0.0f;
    for (int d = 0; d < D; d++) {
        float a = fabsf(x[d]);
        amax = a > amax ? a : amax;
    }
    float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int d = 0; d < D; d++) {
        float r = nearbyintf(x[d] * id);
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        dst[d] = (int8_t)r;
    }
    _Float16 h = (_Float16)(amax / 127.0f);
    memcpy(dst + D, &h, 2);
}

struct i8_args {
    const float *qf;      /* nr rows of D: q * scale in fp32 */
    const int *qpos;      /* each row's position: it sees keys [qpos - window + 1, qpos] */
    int nr;
    const int8_t *kc, *vc; /* this kv head's blocks: kc + (block * bs + j) * (D + 2) is key j of block */
    const int32_t *table; /* the sequence's block ids */
    int bs, D, window;
    float softcap;        /* > 0: scores s -> softcap * tanh(s / softcap) (Gemma 2) */
    float *acc;           /* out: nr rows of D, normalised */
};

void i8_rows_scalar(const struct i8_args *A);
void i8_rows_avx2(const struct i8_args *A);
void i8_rows_avx512(const struct i8_args *A);
void i8_rows_vnni(const struct i8_args *A); /* attention_i8_avx512.c: head dims % 64, block sizes % 16 */

#endif
