// simd_q.h: the per-ISA integer operations on float bit patterns that the 8-bit moment codes
// need and simd.h does not have (shifts, masks, unsigned maxima, packing codes into bytes, the
// AVX2 two-moment bf16 store). Included by kernels_moments.h; the ISA structs are simd.h's.
#pragma once
#include <cstdint>

#include "common.h"
#include "simd.h"

namespace offload {

// Per-ISA pieces of the 8-bit codes that simd.h does not have (integer ops on float bits).
template <class I>
struct QOps;

template <>
struct QOps<ScalarISA> {
  using V = float;
  using Vi = uint32_t;
  static Vi bits(V x) { return f32_bits(x); }
  static V flt(Vi u) { return bits_f32(u); }
  static Vi zero() { return 0u; }
  static Vi shr1(Vi u) { return u >> 1; }
  static Vi shl1(Vi u) { return u << 1; }
  static Vi abs(Vi u) { return u & 0x7FFFFFFFu; }
  static Vi shl1_keep_sign(Vi u) { return (u << 1) | (u & 0x80000000u); }
  static Vi shr1_keep_sign(Vi u) { return ((u & 0x7FFFFFFFu) >> 1) | (u & 0x80000000u); }
  static Vi maxu(Vi a, Vi b) { return a > b ? a : b; }
  static void lanes(uint32_t* out, Vi a) { *out = a; }
};

#if defined(__AVX2__)
template <>
struct QOps<Avx2ISA> {
  using V = __m256;
  using Vi = __m256i;
  static Vi bits(V x) { return _mm256_castps_si256(x); }
  static V flt(Vi u) { return _mm256_castsi256_ps(u); }
  static Vi zero() { return _mm256_setzero_si256(); }
  static Vi shr1(Vi u) { return _mm256_srli_epi32(u, 1); }
  static Vi shl1(Vi u) { return _mm256_slli_epi32(u, 1); }
  static Vi sign(Vi u) { return _mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u))); }
  static Vi abs(Vi u) { return _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)); }
  static Vi or_(Vi a, Vi b) { return _mm256_or_si256(a, b); }
  static Vi shl1_keep_sign(Vi u) { return or_(shl1(u), sign(u)); }
  // shr1(|u|) with u's sign: the arithmetic shift copies the sign into bits 31 and 30, the and
  // clears bit 30 (which shr1 of |u| leaves 0). Two ops instead of and + shift + and + or; with
  // the maximum taken over |m| (q8_encode) the 8-bit loop in L2 took 12.2 -> 11.6-11.8 TSC cycles
  // per 8 elements on Zen 5 (AVX2 path, fp32 grads, five runs; bf16 grad + out 16.6 -> 16.3-16.5;
  // the AVX-512 path, where one ternary-logic op did the or, within noise).
  static Vi shr1_keep_sign(Vi u) {
    return _mm256_and_si256(_mm256_srai_epi32(u, 1), _mm256_set1_epi32(static_cast<int>(0xBFFFFFFFu)));
  }
  static Vi maxu(Vi a, Vi b) { return _mm256_max_epu32(a, b); }
  static void lanes(uint32_t* out, Vi a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), a); }
  // bf16 m and v of 8 elements: round to nearest even (NaN -> 0x7FC0, as f32_to_bf16), both
  // packed with one shuffle chain; the lsb test by compare instead of shift (Zen 3 has two
  // shift/shuffle pipes, and this loop is short of them).
  static __m256i rne_bf16_hi(V x) {  // the bf16 in the high half of each 32-bit lane
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x10000)), _mm256_set1_epi32(0x10000));
    const __m256i r = _mm256_sub_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  }
  static void store2_bf16(uint16_t* pm, uint16_t* pv, V m, V v) {
    const __m256i x = _mm256_blend_epi16(_mm256_srli_epi32(rne_bf16_hi(m), 16), rne_bf16_hi(v), 0xAA);
    const __m256i ctrl = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i y = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, ctrl), 0xD8);  // m0-7 | v0-7
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pm), _mm256_castsi256_si128(y));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pv), _mm256_extracti128_si256(y, 1));
  }
  // 4 vectors of codes (already in range, see q8_block) -> 32 int8 / uint8, in element order
  static void store4_i8(int8_t* p, V a, V b, V c, V d) {
    const __m256i ab = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
    const __m256i cd = _mm256_packs_epi32(_mm256_cvtps_epi32(c), _mm256_cvtps_epi32(d));
    const __m256i x = _mm256_packs_epi16(ab, cd);  // per 128-bit lane: a0 b0 c0 d0 | a1 b1 c1 d1
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  static void store4_u8(uint8_t* p, V a, V b, V c, V d) {
    const __m256i ab = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
    const __m256i cd = _mm256_packs_epi32(_mm256_cvtps_epi32(c), _mm256_cvtps_epi32(d));
    const __m256i x = _mm256_packus_epi16(ab, cd);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
};
#endif

#if defined(__AVX512F__)
template <>
struct QOps<Avx512ISA> {
  using V = __m512;
  using Vi = __m512i;
  static Vi bits(V x) { return _mm512_castps_si512(x); }
  static V flt(Vi u) { return _mm512_castsi512_ps(u); }
  static Vi zero() { return _mm512_setzero_si512(); }
  static Vi shr1(Vi u) { return _mm512_srli_epi32(u, 1); }
  static Vi shl1(Vi u) { return _mm512_slli_epi32(u, 1); }
  static Vi abs(Vi u) { return _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)); }
  // (u << 1) | (u & sign bit) in one ternary-logic op (A | (B & C): 0xF8)
  static Vi shl1_keep_sign(Vi u) {
    return _mm512_ternarylogic_epi32(shl1(u), u, _mm512_set1_epi32(static_cast<int>(0x80000000u)), 0xF8);
  }
  static Vi shr1_keep_sign(Vi u) {  // as QOps<Avx2ISA>
    return _mm512_and_si512(_mm512_srai_epi32(u, 1), _mm512_set1_epi32(static_cast<int>(0xBFFFFFFFu)));
  }
  static Vi maxu(Vi a, Vi b) { return _mm512_max_epu32(a, b); }
  static void lanes(uint32_t* out, Vi a) { _mm512_storeu_si512(out, a); }
  // 4 vectors of codes (in range, see q8_pass2) -> 64 int8 / uint8 in element order: two packs
  // leave dword 4l + k of lane l holding vector k's elements 4l..4l+3; one permute sorts them.
  static __m512i order4(__m512i x) {
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), x);
  }
  static void store4_i8(int8_t* p, V a, V b, V c, V d) {
    const __m512i ab = _mm512_packs_epi32(_mm512_cvtps_epi32(a), _mm512_cvtps_epi32(b));
    const __m512i cd = _mm512_packs_epi32(_mm512_cvtps_epi32(c), _mm512_cvtps_epi32(d));
    _mm512_storeu_si512(p, order4(_mm512_packs_epi16(ab, cd)));
  }
  static void store4_u8(uint8_t* p, V a, V b, V c, V d) {
    const __m512i ab = _mm512_packs_epi32(_mm512_cvtps_epi32(a), _mm512_cvtps_epi32(b));
    const __m512i cd = _mm512_packs_epi32(_mm512_cvtps_epi32(c), _mm512_cvtps_epi32(d));
    _mm512_storeu_si512(p, order4(_mm512_packus_epi16(ab, cd)));
  }
};
#endif

}  // namespace offload

#include "simd_q_arm.h"  // QOps of NeonISA and SveISA
