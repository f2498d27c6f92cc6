/* SIMD helpers shared by the CPU kernels (static inline: every .c file gets its own copy). Each
 * carries the target attribute of its ISA, so the run-time dispatch (isa.h) can call it from a
 * function built for that ISA whatever -march the library was built with. */
#ifndef AE_CPU_SIMD_H
#define AE_CPU_SIMD_H

#include <stdint.h>

#include "isa.h"

#if AE_X86
#include <immintrin.h>

/* exp on 8 lanes (Cephes' polynomial: ~1 ulp over the softmax's range x <= 0). */
static inline AE_TGT_AVX2 __m256 ae_exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    __m256 xx = _mm256_mul_ps(x, x);
    y = _mm256_fmadd_ps(y, xx, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* The same polynomial on 16 lanes. */
static inline AE_TGT_AVX512 __m512 ae_exp16(__m512 x) {
    x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f));
    __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    __m512 xx = _mm512_mul_ps(x, x);
    y = _mm512_fmadd_ps(y, xx, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* bf16 <-> fp32 on 8 / 16 lanes. The stores round to nearest even in integer arithmetic (NaN kept
 * quiet), bit for bit torch's conversion, denormals included (vcvtneps2bf16 flushes them, so the
 * elementwise ops, which must match torch, do not use it). */
static inline AE_TGT_AVX2 __m256 ae_ld_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline AE_TGT_AVX2 void ae_st_bf16x8(uint16_t *p, __m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

static inline AE_TGT_AVX512 __m512 ae_ld_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline AE_TGT_AVX512 void ae_st_bf16x16(uint16_t *p, __m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}

/* The value a bf16 store then load would give, in registers (the elementwise ops' intermediate
 * roundings). */
static inline AE_TGT_AVX2 __m256 ae_round_bf16x8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline AE_TGT_AVX512 __m512 ae_round_bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

/* Soft-capping cap * tanh(s / cap) on 8 / 16 lanes, tanh(x) = 1 - 2 / (exp(2x) + 1) with the exp
 * above: the same operations as attention_rows.h's scalar attn_softcap1, so every ISA caps a score
 * to the same bits (the empty asm keeps -ffp-contract from fusing exp's last multiply into the add). */
static inline AE_TGT_AVX2 __m256 ae_softcap8(__m256 s, float cap) {
    __m256 c = _mm256_set1_ps(cap), x = _mm256_div_ps(s, c);
    __m256 e = ae_exp8(_mm256_add_ps(x, x));
    __asm__("" : "+x"(e));
    __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    __m256 r = _mm256_mul_ps(c, t);
    __asm__("" : "+x"(r));
    return r;
}

static inline AE_TGT_AVX512 __m512 ae_softcap16(__m512 s, float cap) {
    __m512 c = _mm512_set1_ps(cap), x = _mm512_div_ps(s, c);
    __m512 e = ae_exp16(_mm512_add_ps(x, x));
    __asm__("" : "+v"(e));
    __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    __m512 r = _mm512_mul_ps(c, t);
    __asm__("" : "+v"(r));
    return r;
}

static inline AE_TGT_AVX512 float ae_hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

static inline AE_TGT_AVX2 float ae_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif /* AE_X86 */
#endif /* AE_CPU_SIMD_H */
