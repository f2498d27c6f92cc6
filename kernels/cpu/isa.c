/* The instruction set the dense kernels (attention.c, ops.c) run, chosen at run time: a build with
 * -march=native on one machine may be copied to another, and tests force each lower path on the
 * machine they run on (ASYNCENGINE_CPU_ISA, kernels/cpu/isa.py).
 *   0 portable C
 *   1 AVX2 + FMA + F16C, the OS saving the YMM state (XCR0 bits 1, 2)
 *   2 AVX-512 F/BW/VL/VNNI, the OS saving the opmask and ZMM state too (XCR0 bits 5, 6, 7)
 *   3 level 2 + AVX512-BF16 (vdpbf16ps, vcvtneps2bf16)
 *   4 level 3 + AMX-TILE/AMX-BF16 (tdpbf16ps), the OS saving the tile state (XCR0 bits 17, 18) AND
 *     granting this process the tile data (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0):
 *     Linux 5.16+ refuses tile instructions (SIGILL) to a process that did not ask, and a VM or an
 *     older kernel may not grant them at all; then the best level is 3.
 * The int8 GEMM (quant_i8.c) reads the same detection, capped at level 2 (its VNNI copy).
 */
#define _GNU_SOURCE /* syscall() */
#include "isa.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <stdint.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

static uint64_t isa_xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* Ask the kernel for the AMX tile data state (process wide, idempotent): 1 where granted. */
static int isa_amx_granted(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    enum { ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    static int granted = -1; /* asked once per process */
    if (granted < 0) {
        unsigned long perm = 0;
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 &&
                  syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &perm) == 0 && ((perm >> XFEATURE_XTILEDATA) & 1);
    }
    return granted;
#else
    return 0; /* no way to ask: never run a tile instruction */
#endif
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
    const int amx = ((d >> 22) & 1) && ((d >> 24) & 1); /* leaf 7.0 EDX: AMX-BF16, AMX-TILE */
    __cpuid_count(7, 1, a, b, c, d);
    if (!((a >> 5) & 1)) return AE_ISA_AVX512;
    return amx && (x & 0x60000) == 0x60000 && isa_amx_granted() ? AE_ISA_AMX_BF16 : AE_ISA_AVX512_BF16;
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
