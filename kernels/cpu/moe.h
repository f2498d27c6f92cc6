/* A mixture-of-experts layer as one native call (moe.c): the per-op model's MoE layer
 * (asyncengine/layers/moe.py) and the native decode step (step.c) both call it, so the two paths
 * give the same bits by construction. */
#ifndef AE_CPU_MOE_H
#define AE_CPU_MOE_H

#include <stdint.h>

enum { AE_MOE_SOFTMAX_TOPK = 0, AE_MOE_TOPK_SOFTMAX = 1 }; /* layers/moe_router.py's first two kinds */

/* One MoE layer: the router, this rank's experts (block-quantized, each its own format), an
 * optional shared expert. */
typedef struct {
    const float *router;                   /* [E, H] fp32 */
    const uint8_t *const *gate_up;         /* [num_local]: each expert's [gate | up] rows, GGUF blocks */
    const uint8_t *const *down;            /* [num_local] */
    const int32_t *gate_up_type, *down_type; /* [num_local]: GGML type ids (| AE_Q_X8) */
    const uint8_t *shared_gate_up, *shared_down; /* the shared expert (Qwen2-MoE), or NULL */
    const float *shared_gate;              /* [H]: its sigmoid gate's row, or NULL (always on) */
    int32_t shared_gate_up_type, shared_down_type, shared_inter;
    int32_t num_experts, top_k, kind, renormalize;
    int32_t expert_start, num_local, inter; /* this rank's experts [start, start + num_local) */
    int32_t act_int8;                      /* 1: int8 activations (ae_q_gemm_i8), 0: fp32 (ae_q_gemm) */
    float scale;                           /* routed_scaling_factor */
} ae_moe_layer;

/* out [T, H] = this rank's part of the layer's output for x [T, H]; load (may be NULL): [E] tokens
 * routed to each expert, added to. Returns 0, -1 on a failed GEMM, -2 when out of memory. */
int ae_moe_forward(const ae_moe_layer *L, const float *x, int T, int H, float *out, int64_t *load, int nthreads);

#endif /* AE_CPU_MOE_H */
