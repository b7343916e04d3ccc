// simd.h: the tiny vector vocabulary the kernels are written in, one struct per instruction
// set (the aarch64 ones in simd_arm.h). Each struct offers the same static functions, so the
// Adam and grad-stats loops in kernels_impl.h are written once and instantiated per ISA. Every
// operation is a single IEEE-754 operation (no FMA contraction: the build passes
// -ffp-contract=off), so a lane of any ISA computes bit-for-bit what the scalar code computes.
#pragma once
#include "common.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace offload {
// Anonymous namespace: every TU (compiled with different ISA flags) gets its own copy, so the
// linker can never merge an AVX-512 instantiation into the portable path.
namespace {

// Portable path: one element at a time.
struct ScalarISA {
  using V = float;
  static constexpr int W = 1;
  static constexpr bool kQuickBF16Sync = false;  // (Avx2ISA::bf16_quick_in_sync)
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V x) { *p = x; }
  static V load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static V load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  static void store_bf16(uint16_t* p, V x) { *p = f32_to_bf16(x); }
  // store_bf16 of a to p[0, W) and of b to p[W, 2W)
  static void store_bf16x2(uint16_t* p, V a, V b) { p[0] = f32_to_bf16(a); p[1] = f32_to_bf16(b); }
  // x rounded to bf16 (nearest even, NaN -> 0x7FC0) and widened back: store_bf16 then load_bf16
  static V bf16_round_widen(V x) { return bf16_to_f32(f32_to_bf16(x)); }
  static void store_f16(uint16_t* p, V x) { *p = f32_to_f16(x); }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) { return std::sqrt(a); }
  // torch.maximum propagates NaN; so does this.
  static V max(V a, V b) { return (a != a) ? a : ((b != b) ? b : (a > b ? a : b)); }
  static V neg(V a) { return -a; }
  // bits(a) == bits(b) ? x : y, per lane
  static V same_bits_select(V a, V b, V x, V y) {
    uint32_t ua, ub;
    std::memcpy(&ua, &a, 4);
    std::memcpy(&ub, &b, 4);
    return ua == ub ? x : y;
  }
  // Sum of squares in double of W elements (used by grad_stats).
  static double sq(V a) { const double d = a; return d * d; }
  // 8-bit moment codes (moments.h): widen exactly; store rounds to nearest even and clamps.
  static V abs(V a) { return std::fabs(a); }
  static V copysign(V mag, V sgn) { return std::copysign(mag, sgn); }  // mag >= +0
  static V maxf(V a, V b) { return a > b ? a : b; }  // finite inputs only
  static V load_i8(const int8_t* p) { return static_cast<float>(*p); }
  static V load_u8(const uint8_t* p) { return static_cast<float>(*p); }
  static void store_i8(int8_t* p, V x) {
    const float r = std::nearbyint(x);
    *p = static_cast<int8_t>(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
  }
  static void store_u8(uint8_t* p, V x) {
    const float r = std::nearbyint(x);
    *p = static_cast<uint8_t>(r > 255.0f ? 255.0f : (r < 0.0f ? 0.0f : r));
  }
  static void lanes(float* out, V a) { *out = a; }
};

#if defined(__AVX2__)
struct Avx2ISA {
  using V = __m256;
  static constexpr int W = 8;
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static V load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // the bf16 pattern of each lane in its low half: round to nearest even, NaN -> 0x7FC0
  static __m256i bf16_lanes(V x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  }
  static void store_bf16(uint16_t* p, V x) {
    const __m256i r = bf16_lanes(x);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  // store_bf16 of a to p[0, 8) and of b to p[8, 16): one pack, one permute and one store for both
  static void store_bf16x2(uint16_t* p, V a, V b) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_lanes(a), bf16_lanes(b)), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  }
  // store_bf16 then load_bf16 in registers: the rounded high half kept in place, low half zeroed
  static V bf16_round_widen(V x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb),
                                       _mm256_set1_epi32(int(0xFFFF0000u)));
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
  }
  static void store_f16(uint16_t* p, V x) {
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // canonical quiet NaN with the input's sign, as the scalar path
    const __m256 nanmask = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (_mm256_movemask_ps(nanmask)) {
      alignas(32) float xs[8]; alignas(16) uint16_t hs[8];
      _mm256_store_ps(xs, x); _mm_store_si128(reinterpret_cast<__m128i*>(hs), h);
      for (int i = 0; i < 8; ++i) if (std::isnan(xs[i])) hs[i] = f32_to_f16(xs[i]);
      h = _mm_load_si128(reinterpret_cast<const __m128i*>(hs));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V max(V a, V b) {
    // NaN-propagating max: result NaN wherever a or b is NaN (torch.maximum semantics).
    const V m = _mm256_max_ps(a, b);
    const V an = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
    const V bn = _mm256_cmp_ps(b, b, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_blendv_ps(m, b, bn), a, an);
  }
  static V neg(V a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static V same_bits_select(V a, V b, V x, V y) {
    const __m256i eq = _mm256_cmpeq_epi32(_mm256_castps_si256(a), _mm256_castps_si256(b));
    return _mm256_blendv_ps(y, x, _mm256_castsi256_ps(eq));
  }
  // A sufficient test that store_bf16 of p[k] would give u[k] for every k in [0, N) (N a multiple
  // of W): no p[k] is NaN and bits(p[k]) - (u[k] << 16) is within +-0x7FFF, where round to
  // nearest even can only give u[k] (a tie, +-0x8000, or a NaN fails it). 5 ops per vector where
  // the exact per-lane check (bf16_round_widen + same_bits_select) is 9, and none on p's path:
  // on Zen 3 the 32M bf16 step at 1 thread ran 3-7 % faster. (Avx512ISA keeps the per-lane check:
  // its mask ops make that cheaper, and no AVX-512 CPU has measured a group test.)
  static constexpr bool kQuickBF16Sync = true;
  template <int N>
  static bool bf16_quick_in_sync(const float* p, const uint16_t* u) {
    __m256i acc = _mm256_setzero_si256();
    for (int k = 0; k < N; k += W) {
      const V x = load(p + k);
      const __m256i d = _mm256_sub_epi32(_mm256_castps_si256(x), _mm256_castps_si256(load_bf16(u + k)));
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      acc = _mm256_or_si256(acc, _mm256_or_si256(_mm256_abs_epi32(d), nan));
    }
    const bool quick = _mm256_testz_si256(acc, _mm256_set1_epi32(int(0xFFFF8000u)));
    // the update loads p again: kept live from here, those registers made it spill its constants
    __asm__ volatile("" ::: "memory");
    return quick;
  }
  static V abs(V a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static V copysign(V mag, V sgn) { return _mm256_or_ps(mag, _mm256_and_ps(sgn, _mm256_set1_ps(-0.0f))); }
  static V maxf(V a, V b) { return _mm256_max_ps(a, b); }
  static V load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V load_u8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static __m128i round_pack16(V x, int lo, int hi) {  // RNE (MXCSR default), clamp, 8 x int16
    __m256i q = _mm256_cvtps_epi32(x);
    q = _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(hi)), _mm256_set1_epi32(lo));
    return _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  }
  static void store_i8(int8_t* p, V x) {
    const __m128i h = round_pack16(x, -127, 127);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(h, h));
  }
  static void store_u8(uint8_t* p, V x) {
    const __m128i h = round_pack16(x, 0, 255);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(h, h));
  }
  static void lanes(float* out, V a) { _mm256_storeu_ps(out, a); }
};
#endif

#if defined(__AVX512F__)
struct Avx512ISA {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr bool kQuickBF16Sync = false;  // (Avx2ISA::bf16_quick_in_sync)
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  // bf16 <-> fp32 with one word permute each (vpermw: one uop where vpmovzxwd + shift, or shift
  // + vpmovdw, are two or three): word k goes to the high half of lane k, or back.
  static V load_bf16(const uint16_t* p) {
    const __m512i idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0,
                                         7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
    const __m512i w = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, w));
  }
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_bf16(uint16_t* p, V x) {  // round to nearest even; NaN -> 0x7FC0
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 odd = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x10000));
    __m512i r = _mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF));
    r = _mm512_mask_add_epi32(r, odd, r, _mm512_set1_epi32(1));
    const __m512i idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    // word k of the result is lane k's high half where lane k is not NaN, 0x7FC0 where it is
    // (the NaN mask is the permute's write mask: no separate select)
    const __mmask32 ord = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    const __m512i w = _mm512_mask_permutexvar_epi16(_mm512_set1_epi16(0x7FC0), ord, idx, r);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_castsi512_si256(w));
  }
  static void store_bf16x2(uint16_t* p, V a, V b) { store_bf16(p, a); store_bf16(p + 16, b); }
  // store_bf16 then load_bf16 in registers: the rounded high half kept in place, low half zeroed
  static V bf16_round_widen(V x) {
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 odd = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x10000));
    __m512i r = _mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF));
    r = _mm512_mask_add_epi32(r, odd, r, _mm512_set1_epi32(1));
    r = _mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u)));
    const __mmask16 ord = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_set1_epi32(0x7FC00000), ord, r));
  }
  static void store_f16(uint16_t* p, V x) {
    __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    if (nan) {
      // canonical quiet NaN with the input's sign: 0x7E00 | sign
      const __m256i sign = _mm512_cvtepi32_epi16(
          _mm512_srli_epi32(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int(0x80000000u))), 16));
      const __m256i qnan = _mm256_or_si256(sign, _mm256_set1_epi16(0x7E00));
      h = _mm256_mask_mov_epi16(h, nan, qnan);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V max(V a, V b) {
    V m = _mm512_max_ps(a, b);
    m = _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q), b);
    return _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), a);
  }
  static V neg(V a) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(int(0x80000000u))));
  }
  static V same_bits_select(V a, V b, V x, V y) {
    return _mm512_mask_mov_ps(y, _mm512_cmpeq_epi32_mask(_mm512_castps_si512(a), _mm512_castps_si512(b)), x);
  }
  static V abs(V a) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7FFFFFFF)));
  }
  static V copysign(V mag, V sgn) {
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag),
        _mm512_and_si512(_mm512_castps_si512(sgn), _mm512_set1_epi32(int(0x80000000u)))));
  }
  static V maxf(V a, V b) { return _mm512_max_ps(a, b); }
  static V load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V load_u8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static __m512i round_clamp(V x, int lo, int hi) {  // RNE (MXCSR default), clamp
    const __m512i q = _mm512_cvtps_epi32(x);
    return _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(hi)), _mm512_set1_epi32(lo));
  }
  static void store_i8(int8_t* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(round_clamp(x, -127, 127)));
  }
  static void store_u8(uint8_t* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(round_clamp(x, 0, 255)));
  }
  static void lanes(float* out, V a) { _mm512_storeu_ps(out, a); }
};
#endif

}  // namespace
}  // namespace offload

#include "simd_arm.h"  // NeonISA, SveISA (aarch64 translation units only)
