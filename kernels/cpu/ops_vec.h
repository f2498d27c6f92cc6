/* The vector bodies of ops.c's rows, written once and included once per ISA (ops.c sets the
 * macros): they replace the scalar bf16 loops, whose per-element conversions and expf made
 * silu_and_mul 13% and add_rms_norm 3% of a bf16 offline step (py-spy, issue 22).
 *   OV_FN(name)  name -> name_<isa>      OV_TGT  the ISA's target attribute
 *   OV_L lanes, OV_V vector type; OV_LDF / OV_STF fp32, OV_LDB / OV_STB bf16 (RNE), OV_RNDB the
 *   rounding to bf16 in registers, OV_SET1, OV_ADD,
 *   OV_MUL, OV_DIV, OV_FMA, OV_EXP, OV_HSUM
 * Each returns the elements it did (whole vectors); the caller's scalar loop does the rest, with
 * the same rounding steps, so a row's result does not depend on where the split falls.
 */

/* x -> fp32 vector at element i, x fp32 or bf16 */
#define OV_LD(p, i, bf16) ((bf16) ? OV_LDB((const uint16_t *)(p) + (i)) : OV_LDF((const float *)(p) + (i)))
#define OV_ST(p, i, v, bf16) \
    do { if (bf16) OV_STB((uint16_t *)(p) + (i), (v)); else OV_STF((float *)(p) + (i), (v)); } while (0)
/* the value as the dtype holds it */
#define OV_ROUND(v, bf16) ((bf16) ? OV_RNDB(v) : (v))

/* out[d] = round(round(silu(g[d])) * u[d]) */
static inline OV_TGT int OV_FN(ov_silu_row)(const void *x, long xo, void *out, long oo, int inter, int bf16) {
    int d = 0;
    const OV_V one = OV_SET1(1.0f), zero = OV_SET1(0.0f);
    for (; d + OV_L <= inter; d += OV_L) {
        OV_V g = OV_LD(x, xo + d, bf16);
        OV_V s = OV_ROUND(OV_DIV(g, OV_ADD(one, OV_EXP(OV_SUB(zero, g)))), bf16);
        OV_ST(out, oo + d, OV_MUL(s, OV_LD(x, xo + inter + d, bf16)), bf16);
    }
    return d;
}

/* sum of squares of a row (fp32 lanes, then one reduction) */
static inline OV_TGT float OV_FN(ov_sumsq)(const void *x, long xo, int dim, int bf16, int *done) {
    OV_V acc = OV_SET1(0.0f);
    int d = 0;
    for (; d + OV_L <= dim; d += OV_L) {
        OV_V v = OV_LD(x, xo + d, bf16);
        acc = OV_FMA(v, v, acc);
    }
    *done = d;
    return OV_HSUM(acc);
}

/* out[d] = w[d] * round(x[d] * r) */
static inline OV_TGT int OV_FN(ov_scale_row)(const void *x, long xo, void *out, long oo, const void *w, int dim,
                                             float r, int bf16) {
    int d = 0;
    const OV_V rv = OV_SET1(r);
    for (; d + OV_L <= dim; d += OV_L)
        OV_ST(out, oo + d, OV_MUL(OV_LD(w, d, bf16), OV_ROUND(OV_MUL(OV_LD(x, xo + d, bf16), rv), bf16)), bf16);
    return d;
}

/* s[d] = round(a[d] + b[d]) */
static inline OV_TGT int OV_FN(ov_add_row)(const void *a, const void *b, void *s, long o, int dim, int bf16) {
    int d = 0;
    for (; d + OV_L <= dim; d += OV_L) OV_ST(s, o + d, OV_ADD(OV_LD(a, o + d, bf16), OV_LD(b, o + d, bf16)), bf16);
    return d;
}

/* Rotary over one head: out[d] = round(round(x[d] * c[d]) + round(x[swap(d)] * s[d])); the caller
 * guarantees D / 2 % OV_L == 0. No contraction: torch rounds the products before the sum. */
static inline OV_TGT __attribute__((optimize("fp-contract=off"))) void OV_FN(ov_rotary_row)(
        const void *x, long o, void *out, long oo, const void *cs, const void *sn, long c, int D, int bf16) {
    int half = D / 2;
    for (int d = 0; d < D; d += OV_L) {
        long sw = d < half ? d + half : d - half;
        OV_V a = OV_ROUND(OV_MUL(OV_LD(x, o + d, bf16), OV_LD(cs, c + d, bf16)), bf16);
        OV_V b = OV_ROUND(OV_MUL(OV_LD(x, o + sw, bf16), OV_LD(sn, c + d, bf16)), bf16);
        OV_ST(out, oo + d, OV_ADD(a, b), bf16);
    }
}

#undef OV_LD
#undef OV_ST
#undef OV_ROUND
