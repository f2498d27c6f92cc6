/* The x8 layout of quant_common.h, made once at load: in place, group by group (8 rows occupy the
 * same 8 * row_bytes bytes in both layouts), with one group of scratch, so no copy of the weights
 * is ever held.
 *
 * Why repack: on the row layout the int8 kernel ran at ~13 GB/s of weight bytes per thread (a third
 * of one thread's read bandwidth) because per 32-weight block it gathered 8 rows' fp16 scales from
 * 8 addresses and reduced 8 vectors of partial sums with an 8x8 transpose; in the x8 layout both
 * are a load (docs/cpu_decode.md has the figures).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_common.h"

/* n bytes between offset f of the file layout and offset x of the x8 layout, in the direction asked. */
static inline void move(uint8_t *dst, const uint8_t *src, int64_t f, int64_t x, int n, int to_rows) {
    if (to_rows) memcpy(dst + f, src + x, (size_t)n);
    else memcpy(dst + x, src + f, (size_t)n);
}

/* One group of 8 rows: file layout (src) -> x8 (dst), or back (to_rows). */
static void group_x8(int type, const uint8_t *src, uint8_t *dst, int64_t nb, int to_rows) {
    const int bs = block_bytes(type), hdr = type == AE_Q_Q4_1 ? 4 : 2, chunks = type == AE_Q_Q8_0 ? 4 : 2;
    const int64_t row_bytes = nb * bs;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t xb = b * 8 * bs; /* the group's block b in x8 */
        for (int r = 0; r < 8; r++) {
            const int64_t rb = r * row_bytes + b * bs; /* row r's block b in the file */
            move(dst, src, rb, xb + 2 * r, 2, to_rows);                                  /* d */
            if (type == AE_Q_Q4_1) move(dst, src, rb + 2, xb + 16 + 2 * r, 2, to_rows); /* m */
            for (int c = 0; c < chunks; c++) move(dst, src, rb + hdr + 8 * c, xb + 8 * hdr + 64 * c + 8 * r, 8, to_rows);
        }
    }
}

/* One thread on purpose: ~15 ms per 30 MB (the default model's weights: ~50 ms, once), where an
 * OpenMP region per weight cost seconds in all when the host's other load kept one thread waiting. */
static int convert(int type, uint8_t *w, int64_t N, int64_t K, int to_rows) {
    const int bs = block_bytes(type);
    if (!bs || is_kquant(type) || K % 32 || N % 8) return -1; /* K-quants keep the file's rows */
    const int64_t nb = K / 32, gbytes = 8 * nb * bs, groups = N / 8;
    uint8_t *tmp = (uint8_t *)malloc((size_t)gbytes);
    if (!tmp) return -2;
    for (int64_t g = 0; g < groups; g++) {
        uint8_t *grp = w + g * gbytes;
        memcpy(tmp, grp, (size_t)gbytes);
        group_x8(type, tmp, grp, nb, to_rows);
    }
    free(tmp);
    return 0;
}

/* W [N, K] in the file's row layout -> the x8 layout, in place. N must be a multiple of 8. Returns
 * 0, -1 on a bad argument, -2 when out of memory (then nothing is converted). */
int ae_q_repack_x8(int type, uint8_t *w, int64_t N, int64_t K) {
    return convert(type, w, N, K, 0);
}

/* The inverse (x8 -> the file's rows), in place: for a layer whose weight is loaded again. */
int ae_q_unpack_x8(int type, uint8_t *w, int64_t N, int64_t K) {
    return convert(type, w, N, K, 1);
}
