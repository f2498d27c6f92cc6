/* One native call for the decoder layers of a Llama-family step (fp32 activations, block-quantized
 * weights): per layer add + RMSNorm, QKV projection (+ bias), per-head q/k RMSNorm (Qwen3), rotary, KV-cache write, paged
 * attention, output projection, add + RMSNorm, gate/up projection, SiLU-and-mul, down projection
 * (or a mixture-of-experts layer: moe.c, the per-op model's own call for it); then the final add +
 * RMSNorm. It calls the same kernels, in the same order, on the same
 * buffers as the per-op model (asyncengine/models/llama.py), so its results are those of the
 * per-op path bit for bit; what it removes is the ~10 Python-level calls per layer between them
 * (and the interpreter lock: ctypes releases it for the whole call, so an app's Python runs
 * beside the step instead of between its ops).
 *
 * LoRA (lora.c): with adapter rows, each projection's output gets their grouped low-rank product
 * right after its GEMM (as lora/hooks.py's forward hooks add it on the per-op path); base rows are
 * not touched.
 *
 * Batch invariance (issue 24) is a property of the kernels it calls: the int8 GEMM already gives
 * every row the same bits whatever M is; attention splits per (sequence, kv head), never over keys.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lora.h"
#include "moe.h"

/* the kernels of quant.c, quant_i8.c, ops.c, attention.c */
int ae_q_gemm(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias,
              float *out, int64_t ldo, int accumulate, int nthreads);
int ae_q_gemm_i8(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, const float *bias,
                 float *out, int64_t ldo, int accumulate, int nthreads);
void ae_ops_rms_norm(const void *x, long outer_stride, long inner_stride, int n_outer, int n_inner, void *out,
                     const void *w, int dim, float eps, int bf16, int parallel);
void ae_ops_add_rms_norm(const void *x, const void *residual, void *sum_out, void *out, const void *w, int rows,
                         int dim, float eps, int bf16, int parallel);
void ae_ops_rotary(const void *x, long x_stride, void *out, long out_stride, int T, int H, int D, const void *cos,
                   const void *sin_signed, int bf16, int parallel);
void ae_ops_silu_mul(const void *x, long x_stride, void *out, int rows, int inter, int bf16, int parallel);
void ae_attn_write_and_attend(const void *k, long k_stride, const void *v, long v_stride, const int64_t *slots,
                              int T, const void *q, long q_stride, void *out, void *k_cache, void *v_cache,
                              const int32_t *block_ids, const int32_t *block_starts, const int32_t *query_starts,
                              const int32_t *query_lens, const int32_t *context_lens, int num_seqs, int Hq, int Hkv,
                              int D, int NB, int bs, float scale, int window, float softcap, int bf16, int parallel);
void ae_attn_i8_write_and_attend(const void *k, long k_stride, const void *v, long v_stride, const int64_t *slots,
                                 int T, const void *q, long q_stride, void *out, int8_t *k_cache, int8_t *v_cache,
                                 const int32_t *block_ids, const int32_t *block_starts, const int32_t *query_starts,
                                 const int32_t *query_lens, const int32_t *context_lens, int num_seqs, int Hq,
                                 int Hkv, int D, int NB, int bs, float scale, int window, float softcap, int bf16,
                                 int parallel);

/* One decoder layer's weights and KV cache (the Python side fills an array of these once). */
typedef struct {
    const float *in_norm, *post_norm; /* [H] */
    const uint8_t *qkv, *o, *gate_up, *down; /* GGUF blocks, rows of K / 32 blocks */
    const float *qkv_bias;            /* [q + 2 kv] or NULL */
    float *k_cache, *v_cache;         /* [Hkv, NB, bs, D] */
    int32_t qkv_type, o_type, gate_up_type, down_type; /* GGML type ids (| AE_Q_X8: the x8 layout) */
    int32_t window;                   /* sliding window, 0 = none */
    int32_t act_int8;                 /* 1: int8 activations (ae_q_gemm_i8), 0: fp32 (ae_q_gemm) */
    const float *q_norm, *k_norm;     /* [D] per-head RMSNorm weights of q and k (Qwen3), or NULL */
    const ae_moe_layer *moe;          /* a mixture-of-experts MLP (moe.c; gate_up and down unused), or NULL */
    int64_t *moe_load;                /* [E] its routed-token counts, added to (may be NULL) */
} ae_step_layer;

/* The model's shapes and constants. */
typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, num_blocks, block_size;
    float eps, scale;
    int32_t nthreads;
    int32_t kv_int8; /* 1: the caches are the 8-bit layout (attention_i8.h, int8 [Hkv, NB, bs, D + 2]) */
} ae_step_dims;

/* The step's batch: T token rows, their rotary rows and KV slots, the attention's CSR tables. */
typedef struct {
    const float *cos, *sin_signed; /* [T, D] */
    const int64_t *slots;          /* [T] */
    const int32_t *block_ids, *block_starts, *query_starts, *query_lens, *context_lens;
    int32_t T, num_seqs, attn_parallel;
} ae_step_batch;

static int gemm(int act_int8, int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                const float *bias, float *out, int nthreads) {
    return act_int8 ? ae_q_gemm_i8(type, x, M, K, w, N, bias, out, N, 0, nthreads)
                    : ae_q_gemm(type, x, M, K, w, N, bias, out, N, 0, nthreads);
}

/* x: [T, H] the embeddings (overwritten: scratch); hidden: [T, H] the final norm's output; lora:
 * the step's adapters, NULL for none. Returns 0, -1 on a bad argument or a failed GEMM, -2 when
 * out of memory. */
int ae_llama_step(const ae_step_layer *layers, const ae_step_dims *dm, const ae_step_batch *b, float *x,
                  const float *final_norm, float *hidden, const ae_step_lora *lora) {
    const int T = b->T, H = dm->hidden, Hq = dm->num_heads, Hkv = dm->num_kv_heads, D = dm->head_dim;
    const int I = dm->inter, nt = dm->nthreads;
    if (T < 1 || H < 1 || Hq % Hkv) return -1;
    const long q_size = (long)Hq * D, kv_size = (long)Hkv * D, qkv_n = q_size + 2 * kv_size;
    /* one allocation for the step's scratch: residual, h, qkv, attention output, gate_up, act, and
     * the normed q and k heads (Qwen3) */
    const size_t n = (size_t)T * (2 * H + qkv_n + q_size + 2 * (long)I + I + q_size + kv_size);
    ae_lora_groups g = {0};
    if (lora) {
        const int e = ae_lora_groups_init(&g, lora, T);
        if (e) return e;
    }
    float *buf = (float *)malloc(n * sizeof(float));
    if (!buf) {
        if (lora) ae_lora_groups_free(&g);
        return -2;
    }
    const long qkv_parts[3] = {q_size, kv_size, kv_size}, h_part[1] = {H}, gu_parts[2] = {I, I};
    float *res = buf, *h = res + (size_t)T * H, *qkv = h + (size_t)T * H, *att = qkv + (size_t)T * qkv_n;
    float *gu = att + (size_t)T * q_size, *act = gu + (size_t)T * 2 * I;
    float *qn = act + (size_t)T * I, *kn = qn + (size_t)T * q_size;
    int rc = 0;
    for (int l = 0; l < dm->num_layers && !rc; l++) {
        const ae_step_layer *L = layers + l;
        const ae_lora_proj *P = lora ? lora->proj + 4 * (size_t)l : NULL; /* qkv, o, gate_up, down */
        if (l == 0) { /* the first layer's norm has no residual to add: the stream starts as x */
            memcpy(res, x, sizeof(float) * (size_t)T * H);
            ae_ops_rms_norm(x, H, 0, T, 1, h, L->in_norm, H, dm->eps, 0, 0);
        } else {
            ae_ops_add_rms_norm(x, res, res, h, L->in_norm, T, H, dm->eps, 0, 0);
        }
        rc |= gemm(L->act_int8, L->qkv_type, h, T, H, L->qkv, qkv_n, L->qkv_bias, qkv, nt);
        if (P) ae_lora_apply(P, &g, h, H, H, qkv, qkv_n, qkv_parts, 3, nt);
        const float *qp = qkv, *kp = qkv + q_size;
        long q_stride = qkv_n, k_stride = qkv_n;
        if (L->q_norm) { /* Qwen3: each q and k head RMS-normed into its own rows, then rotated there */
            ae_ops_rms_norm(qkv, qkv_n, D, T, Hq, qn, L->q_norm, D, dm->eps, 0, 0);
            ae_ops_rms_norm(qkv + q_size, qkv_n, D, T, Hkv, kn, L->k_norm, D, dm->eps, 0, 0);
            ae_ops_rotary(qn, q_size, qn, q_size, T, Hq, D, b->cos, b->sin_signed, 0, 0);
            ae_ops_rotary(kn, kv_size, kn, kv_size, T, Hkv, D, b->cos, b->sin_signed, 0, 0);
            qp = qn, kp = kn, q_stride = q_size, k_stride = kv_size;
        } else { /* q and k heads side by side in the fused projection: rotated in place, in one pass */
            ae_ops_rotary(qkv, qkv_n, qkv, qkv_n, T, Hq + Hkv, D, b->cos, b->sin_signed, 0, 0);
        }
        if (dm->kv_int8)
            ae_attn_i8_write_and_attend(kp, k_stride, qkv + q_size + kv_size, qkv_n, b->slots, T, qp, q_stride,
                                        att, (int8_t *)L->k_cache, (int8_t *)L->v_cache, b->block_ids,
                                        b->block_starts, b->query_starts, b->query_lens, b->context_lens,
                                        b->num_seqs, Hq, Hkv, D, dm->num_blocks, dm->block_size, dm->scale,
                                        L->window, 0.0f, 0, b->attn_parallel);
        else
            ae_attn_write_and_attend(kp, k_stride, qkv + q_size + kv_size, qkv_n, b->slots, T, qp, q_stride,
                                     att, L->k_cache, L->v_cache, b->block_ids, b->block_starts, b->query_starts,
                                     b->query_lens, b->context_lens, b->num_seqs, Hq, Hkv, D, dm->num_blocks,
                                     dm->block_size, dm->scale, L->window, 0.0f, 0, b->attn_parallel);
        rc |= gemm(L->act_int8, L->o_type, att, T, q_size, L->o, H, NULL, x, nt);
        if (P) ae_lora_apply(P + 1, &g, att, q_size, q_size, x, H, h_part, 1, nt);
        ae_ops_add_rms_norm(x, res, res, h, L->post_norm, T, H, dm->eps, 0, 0);
        if (L->moe) { /* the step's LoRA never reaches here: llama_native refuses adapters on MoE models */
            const int e = ae_moe_forward(L->moe, h, T, H, x, L->moe_load, nt);
            if (e == -2) {
                rc = -2;
                break;
            }
            rc |= e;
            continue;
        }
        rc |= gemm(L->act_int8, L->gate_up_type, h, T, H, L->gate_up, 2 * I, NULL, gu, nt);
        if (P) ae_lora_apply(P + 2, &g, h, H, H, gu, 2 * I, gu_parts, 2, nt);
        ae_ops_silu_mul(gu, 2 * I, act, T, I, 0, 0);
        rc |= gemm(L->act_int8, L->down_type, act, T, I, L->down, H, NULL, x, nt);
        if (P) ae_lora_apply(P + 3, &g, act, I, I, x, H, h_part, 1, nt);
    }
    if (!rc) ae_ops_add_rms_norm(x, res, res, hidden, final_norm, T, H, dm->eps, 0, 0);
    free(buf);
    if (lora) ae_lora_groups_free(&g);
    return rc == -2 ? -2 : rc ? -1 : 0;
}
