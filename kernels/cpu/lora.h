/* LoRA inside the native decode step (lora.c, called by step.c): the adapters' slot stacks as
 * lora/slots.py keeps them, and the step's adapter slot per token row. */
#ifndef AE_CPU_LORA_H
#define AE_CPU_LORA_H

#include <stdint.h>

/* One fused projection's stacks (qkv, o, gate_up or down of one layer). */
typedef struct {
    const float *a;      /* [slots, parts * max_rank, K]: part p's A rows start at row p * max_rank */
    const float *bt;     /* [slots, max_rank, N]: each part's B block transposed, in its own output
                          * columns (B is block-diagonal over the parts: nothing else is nonzero) */
    const int32_t *rank; /* [slots]: the adapter's rank here (0: it has no part in this projection) */
} ae_lora_proj;

/* The step's adapters; NULL for a step of base rows only (then the step is today's bit for bit). */
typedef struct {
    const ae_lora_proj *proj; /* [num_layers * 4]: per layer qkv, o, gate_up, down */
    const int32_t *row_slot;  /* [T]: the row's slot, -1 = the base model */
    int32_t num_slots, max_rank;
} ae_step_lora;

/* The rows of each slot, found once per step and shared by every layer. */
typedef struct {
    int32_t *order;  /* [T]: rows, grouped by slot */
    int32_t *start;  /* [num_slots + 1]: slot s's rows are order[start[s] .. start[s + 1]) */
    float *tmp;      /* [T, 3 * max_rank]: x A^T of each row (3: qkv's parts, the most) */
    int32_t num_slots, max_rank, T;
} ae_lora_groups;

/* 0, -1 on a row slot out of range, -2 when out of memory; ae_lora_groups_free after. */
int ae_lora_groups_init(ae_lora_groups *g, const ae_step_lora *lo, int T);
void ae_lora_groups_free(ae_lora_groups *g);

/* y[rows of slot s] += (x[rows] A_s^T) B_s^T for every slot with rows; base rows untouched.
 * parts: the projection's output widths in order (they sum to the columns it adds to). */
void ae_lora_apply(const ae_lora_proj *p, const ae_lora_groups *g, const float *x, long ldx, long K, float *y,
                   long ldy, const long *parts, int nparts, int nthreads);

#endif /* AE_CPU_LORA_H */
