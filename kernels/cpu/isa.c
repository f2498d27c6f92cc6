/* The instruction set the dense kernels (attention.c, ops.c) run, chosen at run time: a build with
 * -march=native on one machine may be copied to another, and tests force each lower path on the
 * machine they run on (ASYNCENGINE_CPU_ISA, kernels/cpu/isa.py).
 *   0 portable C
 *   1 AVX2 + FMA + F16C, the OS saving the YMM state (XCR0 bits 1, 2)
 *   2 AVX-512 F/BW/VL/VNNI, the OS saving the opmask and ZMM state too (XCR0 bits 5, 6, 7)
 *   3 level 2 + AVX512-BF16 (vdpbf16ps, vcvtneps2bf16)
 * The int8 GEMM (quant_i8.c) reads the same detection, capped at level 2 (its VNNI copy).
 */
#include "isa.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <stdint.h>

static uint64_t isa_xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

int ae_isa_cpu(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return AE_ISA_SCALAR;
    if (!((c >> 27) & 1) || !((c >> 28) & 1) || !((c >> 12) & 1) || !((c >> 29) & 1)) return AE_ISA_SCALAR;
    const uint64_t x = isa_xcr0();
    if ((x & 0x6) != 0x6 || __get_cpuid_max(0, 0) < 7) return AE_ISA_SCALAR;
    __cpuid_count(7, 0, a, b, c, d);
    if (!((b >> 5) & 1)) return AE_ISA_SCALAR;
    const int f = (b >> 16) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1, vnni = (c >> 11) & 1;
    if (!(f && bw && vl && vnni && (x & 0xE6) == 0xE6)) return AE_ISA_AVX2;
    __cpuid_count(7, 1, a, b, c, d);
    return ((a >> 5) & 1) ? AE_ISA_AVX512_BF16 : AE_ISA_AVX512;
#else
    return AE_ISA_SCALAR;
#endif
}

int ae_isa_g = -1; /* the level in use; -1: not chosen yet (ae_isa() picks the best) */

int ae_isa_get(void) { return ae_isa(); }

/* Use level `isa` (-1: the best this CPU runs). Returns the level now in use, or -1 (changing
 * nothing) where the CPU cannot execute it. */
int ae_isa_set(int isa) {
    const int best = ae_isa_cpu();
    if (isa < 0) isa = best;
    if (isa > best) return -1;
    ae_isa_g = isa;
    return isa;
}
