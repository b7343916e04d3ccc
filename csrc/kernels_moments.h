// kernels_moments.h: the Adam update over compressed moments (formats in moments.h), written
// once as templates over the ISA structs of simd.h, like kernels_impl.h (which includes this
// file and provides load_grad, store_out, Coeffs and RareFlags). Same per-element operations in
// the same order as the fp32 kernel, plus the decode before and the encode after:
//   bf16:  m = bf16(m16), v = bf16(v16) ... m16 = rne(m), v16 = rne(v)
//   8bit:  x = q_m * (m_scale / 127);  m = x * |x|;  w = q_v * (v_scale / 255);  v = (w*w) * (w*w)
//          ... r = copysign(root(|m_new|), m_new), u = root(sqrt(v_new)) (the sqrt is the
//          denominator's), block maxima of |r| and of u, then q_m = rne(r * min(127/max|r|,
//          FLT_MAX)), q_v = rne(u * min(255/max u, FLT_MAX)); the scales are the maxima.
//          root() is moments.h's multiply-only square root (no sqrt instruction: on Zen 3 the
//          divide/sqrt unit, not memory, was the 8-bit kernel's limit with three sqrt a vector).
// Everything is elementwise except the two maxima, which are exact in any order, so each ISA's
// lanes compute bit for bit what the scalar reference computes.
//
// Loop structure as adam_loop (kernels_impl.h): pointers, coefficients and flags in locals of the
// loop's own function (a store through p/m/v may alias the task's fields otherwise), DECAY and
// RARE as template parameters, the bf16 loop unrolled 4x.
#pragma once
#include <cfloat>
#include <cstring>
#include <type_traits>

#include "moments.h"

namespace offload {

// Per-ISA pieces of the 8-bit codes that simd.h does not have (integer ops on float bits).
template <class I>
struct QOps;

template <>
struct QOps<ScalarISA> {
  using V = float;
  // seed of the Newton iteration for 1/sqrt(x): bits 0x5F3759DF - (bits(x) >> 1)
  static V rsqrt_seed(V x) { return bits_f32(kRootMagic - (f32_bits(x) >> 1)); }
};

#if defined(__AVX2__)
template <>
struct QOps<Avx2ISA> {
  using V = __m256;
  static V rsqrt_seed(V x) {
    const __m256i i = _mm256_srli_epi32(_mm256_castps_si256(x), 1);
    return _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_set1_epi32(static_cast<int>(kRootMagic)), i));
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
  static V rsqrt_seed(V x) {
    const __m512i i = _mm512_srli_epi32(_mm512_castps_si512(x), 1);
    return _mm512_castsi512_ps(_mm512_sub_epi32(_mm512_set1_epi32(static_cast<int>(kRootMagic)), i));
  }
};
#endif

// moments.h's root(x) for x >= +0: two Newton steps for y ~ 1/sqrt(x) from the bit seed, then
// x * y; multiplies and subtractions only, in this order in every ISA and the reference.
template <class I>
static inline typename I::V q_root(typename I::V x, typename I::V half, typename I::V three_halves) {
  using V = typename I::V;
  V y = QOps<I>::rsqrt_seed(x);
  const V h = I::mul(half, x);
  y = I::mul(y, I::sub(three_halves, I::mul(I::mul(h, y), y)));
  y = I::mul(y, I::sub(three_halves, I::mul(I::mul(h, y), y)));
  return I::mul(x, y);
}

// The fp32 kernel's update of one vector of elements given decoded m, v; returns new p and
// leaves new m, v, sqrt(v) in place. (Same operations as adam_block in kernels_impl.h.)
template <class I, int GD, int OD, bool DECAY, bool RARE>
static inline void q_update(float* __restrict p_, const void* __restrict g_, void* __restrict out_,
                            const Coeffs<I>& c, RareFlags f, int64_t i, typename I::V& m,
                            typename I::V& v, typename I::V& sv) {
  using V = typename I::V;
  V g = load_grad<I, GD>(g_, i);
  if (RARE && f.use_mult) g = I::mul(g, c.mult);
  if (RARE && f.maximize) g = I::neg(g);
  V p = I::load(p_ + i);
  if (RARE && f.use_wd) g = I::add(g, I::mul(c.wd, p));
  if (DECAY) p = I::mul(p, c.decay);
  if (!RARE || f.lerp_low) {
    m = I::add(m, I::mul(c.w1, I::sub(g, m)));
  } else {
    m = I::sub(g, I::mul(I::sub(g, m), c.one_minus_w1));
  }
  v = I::add(I::mul(v, c.beta2), I::mul(I::mul(c.one_minus_beta2, g), g));
  sv = I::sqrt(v);
  const V denom = I::add(I::mul(sv, c.inv_bc2_sqrt), c.eps);
  p = I::add(p, I::div(I::mul(c.neg_step_size, m), denom));
  I::store(p_ + i, p);
  store_out<I, OD>(out_, i, p);
}

template <class I, int GD, int OD, bool DECAY, bool RARE>
static inline void bf16m_elems(float* __restrict p, uint16_t* __restrict m16, uint16_t* __restrict v16,
                               const void* __restrict g, void* __restrict out, const Coeffs<I>& c, RareFlags f,
                               int64_t i) {
  using V = typename I::V;
  V m = I::load_bf16(m16 + i), v = I::load_bf16(v16 + i), sv;
  q_update<I, GD, OD, DECAY, RARE>(p, g, out, c, f, i, m, v, sv);
  I::store_bf16(m16 + i, m);
  I::store_bf16(v16 + i, v);
}

// Elements [begin, end) of one tensor with bf16 moments (blocks only matter to the partition).
template <class I, int GD, int OD, bool DECAY, bool RARE>
static void bf16m_loop(const AdamQTask& t, const AdamScalars& s, int64_t begin, int64_t end) {
  constexpr int W = I::W;
  constexpr int kUnroll = 4;
  float* const __restrict p = t.p;
  uint16_t* const __restrict m16 = static_cast<uint16_t*>(t.m);
  uint16_t* const __restrict v16 = static_cast<uint16_t*>(t.v);
  const void* const __restrict g = t.g;
  void* const __restrict out = t.out;
  const RareFlags f{s.use_mult, s.maximize, s.use_wd, s.lerp_low};
  const Coeffs<I> c(s);
  int64_t i = begin;
  for (; i + kUnroll * W <= end; i += kUnroll * W) {
    for (int u = 0; u < kUnroll; ++u) bf16m_elems<I, GD, OD, DECAY, RARE>(p, m16, v16, g, out, c, f, i + u * W);
  }
  for (; i + W <= end; i += W) bf16m_elems<I, GD, OD, DECAY, RARE>(p, m16, v16, g, out, c, f, i);
  if (i < end) {
    const Coeffs<ScalarISA> cs(s);
    for (; i < end; ++i) bf16m_elems<ScalarISA, GD, OD, DECAY, RARE>(p, m16, v16, g, out, cs, f, i);
  }
}

// One element (or vector) of an 8-bit block, pass 1: decode, update, root codes to the scratch.
template <class I, int GD, int OD, bool DECAY, bool RARE>
static inline void q8_elems(float* __restrict p, const int8_t* __restrict mq, const uint8_t* __restrict vq,
                            const void* __restrict g, void* __restrict out, const Coeffs<I>& c, RareFlags f,
                            int64_t i, int j, typename I::V vmd, typename I::V vvd, typename I::V half,
                            typename I::V three_halves, float* __restrict rbuf, float* __restrict ubuf,
                            typename I::V& am, typename I::V& au, typename I::V& fin) {
  using V = typename I::V;
  const V x = I::mul(I::load_i8(mq + j), vmd);
  V m = I::mul(x, I::abs(x));
  const V w = I::mul(I::load_u8(vq + j), vvd);
  const V w2 = I::mul(w, w);
  V v = I::mul(w2, w2), sv;
  q_update<I, GD, OD, DECAY, RARE>(p, g, out, c, f, i, m, v, sv);
  const V ra = q_root<I>(I::abs(m), half, three_halves);
  const V u = q_root<I>(sv, half, three_halves);
  I::store(rbuf + j, I::copysign(ra, m));
  I::store(ubuf + j, u);
  am = I::maxf(am, ra);
  au = I::maxf(au, u);
  fin = I::add(fin, I::add(ra, u));  // stays finite iff every ra and u is (all >= 0, no overflow)
}

// One 256-element block (or the shorter last one) of an 8-bit tensor.
template <class I, int GD, int OD, bool DECAY, bool RARE>
static inline void q8_block(float* __restrict p, int8_t* __restrict mq0, uint8_t* __restrict vq0,
                            float* __restrict msc, float* __restrict vsc, const void* __restrict g,
                            void* __restrict out, int64_t n, const Coeffs<I>& c, const Coeffs<ScalarISA>& cs,
                            RareFlags f, int64_t blk) {
  using V = typename I::V;
  constexpr int W = I::W;
  const int64_t i0 = blk * kQBlock;
  const int len = static_cast<int>(n - i0 < kQBlock ? n - i0 : kQBlock);
  int8_t* const mq = mq0 + i0;
  uint8_t* const vq = vq0 + i0;
  const float md = msc[blk] / 127.0f, vd = vsc[blk] / 255.0f;
  alignas(64) float rbuf[kQBlock], ubuf[kQBlock];
  const V zero = I::set1(0.0f), half = I::set1(0.5f), th = I::set1(1.5f);
  const V vmd = I::set1(md), vvd = I::set1(vd);
  V am = zero, au = zero, fin = zero;
  int j = 0;
  for (; j + W <= len; j += W)
    q8_elems<I, GD, OD, DECAY, RARE>(p, mq, vq, g, out, c, f, i0 + j, j, vmd, vvd, half, th, rbuf, ubuf, am, au, fin);
  float am_s = 0.0f, au_s = 0.0f, fin_s = 0.0f;
  for (; j < len; ++j)
    q8_elems<ScalarISA, GD, OD, DECAY, RARE>(p, mq, vq, g, out, cs, f, i0 + j, j, md, vd, 0.5f, 1.5f, rbuf, ubuf,
                                             am_s, au_s, fin_s);
  alignas(64) float la[W], lu[W], lf[W];
  I::lanes(la, am);
  I::lanes(lu, au);
  I::lanes(lf, fin);
  bool poisoned = !std::isfinite(fin_s);
  for (int k = 0; k < W; ++k) {
    am_s = ScalarISA::maxf(am_s, la[k]);
    au_s = ScalarISA::maxf(au_s, lu[k]);
    poisoned = poisoned || !std::isfinite(lf[k]);
  }
  if (poisoned) {
    std::memset(mq, 0, len);
    std::memset(vq, 0, len);
    msc[blk] = vsc[blk] = std::nanf("");
    return;
  }
  // |r| * im <= 127 (1 + 2^-23) and u * iu <= 255 (1 + 2^-23): every code is in range, so the
  // reference's clamp never acts and saturating packs give the same bytes.
  const float im = am_s > 0.0f ? std::fmin(127.0f / am_s, FLT_MAX) : 0.0f;
  const float iu = au_s > 0.0f ? std::fmin(255.0f / au_s, FLT_MAX) : 0.0f;
  const V vim = I::set1(im), viu = I::set1(iu);
  j = 0;
  if constexpr (!std::is_same_v<I, ScalarISA> && W == 8) {
    for (; j + 4 * W <= len; j += 4 * W) {
      QOps<I>::store4_i8(mq + j, I::mul(I::load(rbuf + j), vim), I::mul(I::load(rbuf + j + W), vim),
                         I::mul(I::load(rbuf + j + 2 * W), vim), I::mul(I::load(rbuf + j + 3 * W), vim));
      QOps<I>::store4_u8(vq + j, I::mul(I::load(ubuf + j), viu), I::mul(I::load(ubuf + j + W), viu),
                         I::mul(I::load(ubuf + j + 2 * W), viu), I::mul(I::load(ubuf + j + 3 * W), viu));
    }
  }
  for (; j + W <= len; j += W) {
    I::store_i8(mq + j, I::mul(I::load(rbuf + j), vim));
    I::store_u8(vq + j, I::mul(I::load(ubuf + j), viu));
  }
  for (; j < len; ++j) {
    ScalarISA::store_i8(mq + j, rbuf[j] * im);
    ScalarISA::store_u8(vq + j, ubuf[j] * iu);
  }
  msc[blk] = am_s;
  vsc[blk] = au_s;
}

template <class I, int GD, int OD, bool DECAY, bool RARE>
static void q8_loop(const AdamQTask& t, const AdamScalars& s, int64_t bb, int64_t be) {
  float* const __restrict p = t.p;
  int8_t* const __restrict mq = static_cast<int8_t*>(t.m);
  uint8_t* const __restrict vq = static_cast<uint8_t*>(t.v);
  float* const __restrict msc = t.m_scale;
  float* const __restrict vsc = t.v_scale;
  const void* const __restrict g = t.g;
  void* const __restrict out = t.out;
  const int64_t n = t.n;
  const RareFlags f{s.use_mult, s.maximize, s.use_wd, s.lerp_low};
  const Coeffs<I> c(s);
  const Coeffs<ScalarISA> cs(s);
  for (int64_t b = bb; b < be; ++b) q8_block<I, GD, OD, DECAY, RARE>(p, mq, vq, msc, vsc, g, out, n, c, cs, f, b);
}

// Blocks [bb, be) of one tensor (bf16 moments: the same element range).
template <class I, int GD, int OD, bool DECAY, bool RARE>
static void q_loop(const AdamQTask& t, const AdamScalars& s, int64_t bb, int64_t be) {
  if (t.mfmt == kMom8) return q8_loop<I, GD, OD, DECAY, RARE>(t, s, bb, be);
  const int64_t end = be * kQBlock < t.n ? be * kQBlock : t.n;
  bf16m_loop<I, GD, OD, DECAY, RARE>(t, s, bb * kQBlock, end);
}

template <class I, int GD, int OD>
static void q_range_t(const AdamQTask& t, const AdamScalars& s, int64_t bb, int64_t be) {
  const bool rare = s.use_mult || s.maximize || s.use_wd || !s.lerp_low;
  switch ((s.use_decay ? 2 : 0) | (rare ? 1 : 0)) {
    case 0: return q_loop<I, GD, OD, false, false>(t, s, bb, be);
    case 1: return q_loop<I, GD, OD, false, true>(t, s, bb, be);
    case 2: return q_loop<I, GD, OD, true, false>(t, s, bb, be);
    default: return q_loop<I, GD, OD, true, true>(t, s, bb, be);
  }
}

template <class I, int GD>
static void q_range_gd(const AdamQTask& t, const AdamScalars& s, int64_t bb, int64_t be) {
  switch (t.odtype) {
    case kNone: return q_range_t<I, GD, kNone>(t, s, bb, be);
    case kBF16: return q_range_t<I, GD, kBF16>(t, s, bb, be);
    case kF16: return q_range_t<I, GD, kF16>(t, s, bb, be);
    default: return q_range_t<I, GD, kF32>(t, s, bb, be);
  }
}

// Entry of the kernel table: blocks [bb, be) of one tensor with compressed moments.
template <class I>
static void adam_q_range(const AdamQTask& t, const AdamScalars& s, int64_t bb, int64_t be) {
  switch (t.gdtype) {
    case kBF16: return q_range_gd<I, kBF16>(t, s, bb, be);
    case kF16: return q_range_gd<I, kF16>(t, s, bb, be);
    default: return q_range_gd<I, kF32>(t, s, bb, be);
  }
}

}  // namespace offload
