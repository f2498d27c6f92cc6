/* Paged attention as AMX-BF16 tile products (attention_amx.c), for bf16 caches: what attention.c
 * calls in place of its per-row loops where isa.c grants level AE_ISA_AMX_BF16. */
#ifndef AE_ATTENTION_AMX_H
#define AE_ATTENTION_AMX_H

#include <stdint.h>

/* 1 where the tile kernel takes these shapes (head dim a multiple of 32 up to 256, blocks of a
 * multiple of 16 keys); the caller checks the ISA level and the cache type. */
int ae_attn_amx_takes(int D, int bs);

/* ae_attn_paged's contract (attention.c) for bf16 q, out and caches, without splits over keys, for
 * the sequences of at least AMX_MIN_ROWS query rows: *rest_out gets the query lengths left to the
 * caller's loops (those sequences' zeroed), valid until the caller frees the returned pointer. */
void *ae_attn_paged_amx(const void *q, long q_stride, void *out, const void *k_cache, const void *v_cache,
                        const int32_t *block_ids, const int32_t *block_starts, const int32_t *query_starts,
                        const int32_t *query_lens, const int32_t *context_lens, int num_seqs, int Hq, int Hkv,
                        int D, int NB, int bs, float scale, int window, float softcap, int parallel,
                        const int32_t **rest_out);

#endif
