// simd_q_arm.h: simd_q.h's integer operations on float bit patterns (the 8-bit moment codes) for
// the aarch64 ISAs of simd_arm.h. Included by simd_q.h after its x86 specializations.
#pragma once

namespace offload {

#if defined(__aarch64__) && defined(__ARM_NEON)
template <>
struct QOps<NeonISA> {
  using V = float32x4_t;
  using Vi = uint32x4_t;
  static Vi bits(V x) { return vreinterpretq_u32_f32(x); }
  static V flt(Vi u) { return vreinterpretq_f32_u32(u); }
  static Vi zero() { return vdupq_n_u32(0); }
  static Vi shr1(Vi u) { return vshrq_n_u32(u, 1); }
  static Vi shl1(Vi u) { return vshlq_n_u32(u, 1); }
  static Vi abs(Vi u) { return vandq_u32(u, vdupq_n_u32(0x7FFFFFFFu)); }
  static Vi shl1_keep_sign(Vi u) {  // (u << 1) | sign: the or keeps bit 30 of u too (a NaN's)
    return vorrq_u32(shl1(u), vandq_u32(u, vdupq_n_u32(0x80000000u)));
  }
  // SRI keeps the destination's top bit (u's sign) and inserts |u| >> 1 below it
  static Vi shr1_keep_sign(Vi u) { return vsriq_n_u32(u, abs(u), 1); }
  static Vi maxu(Vi a, Vi b) { return vmaxq_u32(a, b); }
  static void lanes(uint32_t* out, Vi a) { vst1q_u32(out, a); }
  // 4 vectors of codes (in range, see q8_pass2) -> 16 int8 / uint8 in element order: nearest even
  // (FCVTNS), then saturating narrows as the x86 packs
  static int16x8_t codes16(V a, V b) {
    return vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(a)), vqmovn_s32(vcvtnq_s32_f32(b)));
  }
  static void store4_i8(int8_t* p, V a, V b, V c, V d) {
    vst1q_s8(p, vcombine_s8(vqmovn_s16(codes16(a, b)), vqmovn_s16(codes16(c, d))));
  }
  static void store4_u8(uint8_t* p, V a, V b, V c, V d) {
    vst1q_u8(p, vcombine_u8(vqmovun_s16(codes16(a, b)), vqmovun_s16(codes16(c, d))));
  }
};
#endif

#if defined(__ARM_FEATURE_SVE_BITS) && __ARM_FEATURE_SVE_BITS > 0
template <>
struct QOps<SveISA> {
  using V = SveF32;
  using Vi = SveU32;
  static svbool_t all() { return svptrue_b32(); }
  static Vi bits(V x) { return svreinterpret_u32_f32(x); }
  static V flt(Vi u) { return svreinterpret_f32_u32(u); }
  static Vi zero() { return svdup_n_u32(0); }
  static Vi shr1(Vi u) { return svlsr_n_u32_x(all(), u, 1); }
  static Vi shl1(Vi u) { return svlsl_n_u32_x(all(), u, 1); }
  static Vi abs(Vi u) { return svand_n_u32_x(all(), u, 0x7FFFFFFFu); }
  static Vi shl1_keep_sign(Vi u) {
    return svorr_u32_x(all(), shl1(u), svand_n_u32_x(all(), u, 0x80000000u));
  }
  static Vi shr1_keep_sign(Vi u) {  // as QOps<Avx2ISA>
    const svint32_t s = svasr_n_s32_x(all(), svreinterpret_s32_u32(u), 1);
    return svand_n_u32_x(all(), svreinterpret_u32_s32(s), 0xBFFFFFFFu);
  }
  static Vi maxu(Vi a, Vi b) { return svmax_u32_x(all(), a, b); }
  static void lanes(uint32_t* out, Vi a) { svst1_u32(all(), out, a); }
  // 4 vectors of codes (in range, see q8_pass2) -> 4W bytes in element order: each code's low
  // byte (the codes fit, so this is the x86 saturating pack's byte), picked by two unzips
  static svint16_t codes16(V a, V b) {
    return svuzp1_s16(svreinterpret_s16_s32(SveISA::round_int(a)),
                      svreinterpret_s16_s32(SveISA::round_int(b)));
  }
  static svint8_t codes8(V a, V b, V c, V d) {
    return svuzp1_s8(svreinterpret_s8_s16(codes16(a, b)), svreinterpret_s8_s16(codes16(c, d)));
  }
  static void store4_i8(int8_t* p, V a, V b, V c, V d) {
    svst1_s8(svptrue_b8(), p, codes8(a, b, c, d));
  }
  static void store4_u8(uint8_t* p, V a, V b, V c, V d) {
    svst1_u8(svptrue_b8(), p, svreinterpret_u8_s8(codes8(a, b, c, d)));
  }
};
#endif

}  // namespace offload
