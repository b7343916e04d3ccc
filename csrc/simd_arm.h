// simd_arm.h: the aarch64 members of simd.h's vocabulary: NeonISA (128-bit Advanced SIMD, the
// aarch64 baseline) and SveISA (SVE built for one fixed vector length: -msve-vector-bits=N, so
// that a vector is a sized type the kernels can keep in structs and arrays, as on x86). Every
// operation is the scalar path's IEEE operation (FDIV, FSQRT: never the FRECPE/FRSQRTE
// estimates); the bf16 rounding is done in integers as in common.h (no BFCVT), fp16 goes
// through FCVT with NaN lanes replaced by f32_to_f16's canonical NaN, so each lane computes bit
// for bit what ScalarISA computes (with the default FPCR: round to nearest, no flush to zero).
// Included by simd.h; which struct exists depends on the translation unit's flags (setup.py).
#pragma once
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#if defined(__ARM_FEATURE_SVE_BITS) && __ARM_FEATURE_SVE_BITS > 0
#include <arm_sve.h>
#endif

namespace offload {
namespace {  // as simd.h: each translation unit its own copy

#if defined(__aarch64__) && defined(__ARM_NEON)
struct NeonISA {
  using V = float32x4_t;
  using U = uint32x4_t;
  static constexpr int W = 4;
  static constexpr bool kQuickBF16Sync = false;  // (Avx2ISA::bf16_quick_in_sync)
  static U u(V x) { return vreinterpretq_u32_f32(x); }
  static V f(U x) { return vreinterpretq_f32_u32(x); }
  static V set1(float x) { return vdupq_n_f32(x); }
  static V load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, V x) { vst1q_f32(p, x); }
  static V load_bf16(const uint16_t* p) { return f(vshll_n_u16(vld1_u16(p), 16)); }
  // FCVTL is exact but quiets a signalling NaN, which f16_to_f32 keeps signalling: no result
  // differs, as every use of a widened value either is an IEEE operation (which quiets it) or
  // compares its bits with a widened f32_to_f16 (adopt_user_writes), never a signalling NaN
  static V load_f16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
  // the bf16 of each lane in its high half (low half not cleared): nearest even, NaN -> 0x7FC0
  static U bf16_hi(V x) {
    const U lsb = vandq_u32(vshrq_n_u32(u(x), 16), vdupq_n_u32(1));
    const U r = vaddq_u32(vaddq_u32(u(x), vdupq_n_u32(0x7FFF)), lsb);
    return vbslq_u32(vceqq_f32(x, x), r, vdupq_n_u32(0x7FC00000u));
  }
  static void store_bf16(uint16_t* p, V x) { vst1_u16(p, vshrn_n_u32(bf16_hi(x), 16)); }
  static void store_bf16x2(uint16_t* p, V a, V b) {
    vst1q_u16(p, vshrn_high_n_u32(vshrn_n_u32(bf16_hi(a), 16), bf16_hi(b), 16));
  }
  static V bf16_round_widen(V x) { return f(vandq_u32(bf16_hi(x), vdupq_n_u32(0xFFFF0000u))); }
  // FCVTN rounds to nearest even (FPCR) with subnormals and overflow as f32_to_f16; a NaN keeps
  // its payload there, so NaN lanes take f32_to_f16's 0x7E00 | sign
  static void store_f16(uint16_t* p, V x) {
    const uint16x4_t h = vreinterpret_u16_f16(vcvt_f16_f32(x));
    const uint16x4_t nan = vmovn_u32(vmvnq_u32(vceqq_f32(x, x)));
    const uint16x4_t sign = vshrn_n_u32(vandq_u32(u(x), vdupq_n_u32(0x80000000u)), 16);
    const uint16x4_t q = vorr_u16(sign, vdup_n_u16(0x7E00));
    vst1_u16(p, vbsl_u16(nan, q, h));
  }
  static V add(V a, V b) { return vaddq_f32(a, b); }
  static V sub(V a, V b) { return vsubq_f32(a, b); }
  static V mul(V a, V b) { return vmulq_f32(a, b); }
  static V div(V a, V b) { return vdivq_f32(a, b); }
  static V sqrt(V a) { return vsqrtq_f32(a); }
  // ScalarISA::max by selects (FMAX orders +0 above -0 and quiets a NaN; the scalar path does not)
  static V max(V a, V b) {
    const V m = vbslq_f32(vcgtq_f32(a, b), a, b);
    return vbslq_f32(vceqq_f32(a, a), vbslq_f32(vceqq_f32(b, b), m, b), a);
  }
  static V neg(V a) { return vnegq_f32(a); }  // FNEG: the sign bit only, as the scalar -a
  static V same_bits_select(V a, V b, V x, V y) { return vbslq_f32(vceqq_u32(u(a), u(b)), x, y); }
  static V load_i8(const int8_t* p) {
    int32_t w;
    std::memcpy(&w, p, 4);
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w))))));
  }
  static V load_u8(const uint8_t* p) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(w))))));
  }
  // FCVTNS: to nearest even (ScalarISA's nearbyint in the default mode), then the clamp
  static int32x4_t round_clamp(V x, int lo, int hi) {
    return vmaxq_s32(vminq_s32(vcvtnq_s32_f32(x), vdupq_n_s32(hi)), vdupq_n_s32(lo));
  }
  static void store_i8(int8_t* p, V x) {
    const int16x4_t h = vmovn_s32(round_clamp(x, -127, 127));
    const uint32_t w = vget_lane_u32(vreinterpret_u32_s8(vmovn_s16(vcombine_s16(h, h))), 0);
    std::memcpy(p, &w, 4);
  }
  static void store_u8(uint8_t* p, V x) {
    const uint16x4_t h = vmovn_u32(vreinterpretq_u32_s32(round_clamp(x, 0, 255)));
    const uint32_t w = vget_lane_u32(vreinterpret_u32_u8(vmovn_u16(vcombine_u16(h, h))), 0);
    std::memcpy(p, &w, 4);
  }
  static void lanes(float* out, V a) { vst1q_f32(out, a); }
};
#endif

#if defined(__ARM_FEATURE_SVE_BITS) && __ARM_FEATURE_SVE_BITS > 0
// Fixed-length types: this translation unit runs only where the vector length is exactly
// __ARM_FEATURE_SVE_BITS (cpu_features.cpp chooses it; kernels_sve.h checks each call).
typedef svfloat32_t SveF32 __attribute__((arm_sve_vector_bits(__ARM_FEATURE_SVE_BITS)));
typedef svuint32_t SveU32 __attribute__((arm_sve_vector_bits(__ARM_FEATURE_SVE_BITS)));

struct SveISA {
  using V = SveF32;
  using U = SveU32;
  static constexpr int kBits = __ARM_FEATURE_SVE_BITS;
  static constexpr int W = kBits / 32;
  static constexpr bool kQuickBF16Sync = false;  // (Avx2ISA::bf16_quick_in_sync)
  static svbool_t all() { return svptrue_b32(); }
  static U u(V x) { return svreinterpret_u32_f32(x); }
  static V f(U x) { return svreinterpret_f32_u32(x); }
  static U dupu(uint32_t x) { return svdup_n_u32(x); }
  static V set1(float x) { return svdup_n_f32(x); }
  static V load(const float* p) { return svld1_f32(all(), p); }
  static void store(float* p, V x) { svst1_f32(all(), p, x); }
  static V load_bf16(const uint16_t* p) {
    return f(svlsl_n_u32_x(all(), svld1uh_u32(all(), p), 16));
  }
  // FCVT widens the half in the low 16 bits of each lane (where LD1H put it); NaNs as NeonISA
  static V load_f16(const uint16_t* p) {
    return svcvt_f32_f16_x(all(), svreinterpret_f16_u32(svld1uh_u32(all(), p)));
  }
  static U bf16_hi(V x) {  // as NeonISA::bf16_hi
    const U lsb = svand_n_u32_x(all(), svlsr_n_u32_x(all(), u(x), 16), 1);
    const U r = svadd_u32_x(all(), svadd_n_u32_x(all(), u(x), 0x7FFF), lsb);
    return svsel_u32(svcmpuo_f32(all(), x, x), dupu(0x7FC00000u), r);
  }
  static void store_bf16(uint16_t* p, V x) {
    svst1h_u32(all(), p, svlsr_n_u32_x(all(), bf16_hi(x), 16));
  }
  static void store_bf16x2(uint16_t* p, V a, V b) {  // the high halves of a's lanes, then b's
    const svuint16_t ha = svreinterpret_u16_u32(bf16_hi(a));
    svst1_u16(svptrue_b16(), p, svuzp2_u16(ha, svreinterpret_u16_u32(bf16_hi(b))));
  }
  static V bf16_round_widen(V x) { return f(svand_n_u32_x(all(), bf16_hi(x), 0xFFFF0000u)); }
  // as NeonISA::store_f16; FCVT leaves the half in the low 16 bits of each lane
  static void store_f16(uint16_t* p, V x) {
    const U h = svreinterpret_u32_f16(svcvt_f16_f32_x(all(), x));
    const U sign = svand_n_u32_x(all(), svlsr_n_u32_x(all(), u(x), 16), 0x8000);
    const U q = svorr_n_u32_x(all(), sign, 0x7E00);
    svst1h_u32(all(), p, svsel_u32(svcmpuo_f32(all(), x, x), q, h));
  }
  static V add(V a, V b) { return svadd_f32_x(all(), a, b); }
  static V sub(V a, V b) { return svsub_f32_x(all(), a, b); }
  static V mul(V a, V b) { return svmul_f32_x(all(), a, b); }
  static V div(V a, V b) { return svdiv_f32_x(all(), a, b); }
  static V sqrt(V a) { return svsqrt_f32_x(all(), a); }
  static V max(V a, V b) {  // as NeonISA::max
    const V m = svsel_f32(svcmpgt_f32(all(), a, b), a, b);
    return svsel_f32(svcmpuo_f32(all(), a, a), a, svsel_f32(svcmpuo_f32(all(), b, b), b, m));
  }
  static V neg(V a) { return svneg_f32_x(all(), a); }
  static V same_bits_select(V a, V b, V x, V y) {
    return svsel_f32(svcmpeq_u32(all(), u(a), u(b)), x, y);
  }
  static V load_i8(const int8_t* p) { return svcvt_f32_s32_x(all(), svld1sb_s32(all(), p)); }
  static V load_u8(const uint8_t* p) { return svcvt_f32_u32_x(all(), svld1ub_u32(all(), p)); }
  // FRINTN (nearest even) then an exact conversion: ScalarISA's nearbyint in the default mode
  static svint32_t round_int(V x) { return svcvt_s32_f32_x(all(), svrintn_f32_x(all(), x)); }
  static svint32_t round_clamp(V x, int lo, int hi) {
    return svmax_n_s32_x(all(), svmin_n_s32_x(all(), round_int(x), hi), lo);
  }
  static void store_i8(int8_t* p, V x) { svst1b_s32(all(), p, round_clamp(x, -127, 127)); }
  static void store_u8(uint8_t* p, V x) {
    svst1b_u32(all(), p, svreinterpret_u32_s32(round_clamp(x, 0, 255)));
  }
  static void lanes(float* out, V a) { svst1_f32(all(), out, a); }
};
#endif

}  // namespace
}  // namespace offload
