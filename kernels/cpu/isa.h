/* The dense kernels' instruction-set level (isa.c): read once per call, so a forced level applies
 * to the next call. */
#ifndef AE_CPU_ISA_H
#define AE_CPU_ISA_H

enum { AE_ISA_SCALAR = 0, AE_ISA_AVX2 = 1, AE_ISA_AVX512 = 2, AE_ISA_AVX512_BF16 = 3, AE_ISA_AMX_BF16 = 4 };

extern int ae_isa_g;
int ae_isa_cpu(void);
int ae_isa_set(int isa);

static inline int ae_isa(void) {
    if (ae_isa_g < 0) ae_isa_g = ae_isa_cpu();
    return ae_isa_g;
}

#if defined(__x86_64__) || defined(__i386__)
#define AE_X86 1
#define AE_TGT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define AE_TGT_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))
#define AE_TGT_AVX512_BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")))
#define AE_TGT_AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#else
#define AE_X86 0
#endif

#endif /* AE_CPU_ISA_H */
