// kernels_moments.h: the Adam update over compressed moments (formats in moments.h), written
// once as templates over the ISA structs of simd.h, like kernels_impl.h (which includes this
// file and provides load_grad, store_out, Coeffs and RareFlags). Same per-element operations in
// the same order as the fp32 kernel, plus the decode before and the encode after:
//   bf16:  m = bf16(m16), v = bf16(v16) ... m16 = rne(m), v16 = rne(v)
//   8bit:  x = q_m * (m_scale / 127);  m = x * |x|;  w = q_v * (v_scale / 255);  v = (w*w) * (w*w)
//          ... r = copysign(sqrt(|m_new|), m_new), u = sqrt(sqrt(v_new)) (the inner sqrt is the
//          denominator's), block maxima of |r| and of u, then q_m = rne(r * min(127/max|r|,
//          FLT_MAX)), q_v = rne(u * min(255/max u, FLT_MAX)), clamped; the scales are the maxima.
// Everything is elementwise except the two maxima, which are exact in any order, so each ISA's
// lanes compute bit for bit what the scalar reference computes.
#pragma once
#include <cfloat>

#include "moments.h"

namespace offload {

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
static inline void bf16m_elems(const AdamQTask& t, const Coeffs<I>& c, RareFlags f, int64_t i) {
  using V = typename I::V;
  uint16_t* const m16 = static_cast<uint16_t*>(t.m);
  uint16_t* const v16 = static_cast<uint16_t*>(t.v);
  V m = I::load_bf16(m16 + i), v = I::load_bf16(v16 + i), sv;
  q_update<I, GD, OD, DECAY, RARE>(t.p, t.g, t.out, c, f, i, m, v, sv);
  I::store_bf16(m16 + i, m);
  I::store_bf16(v16 + i, v);
}

// One 256-element block (or the shorter last one) of an 8-bit tensor.
template <class I, int GD, int OD, bool DECAY, bool RARE>
static void q8_block(const AdamQTask& t, const Coeffs<I>& c, const Coeffs<ScalarISA>& cs, RareFlags f,
                     int64_t blk) {
  using V = typename I::V;
  constexpr int W = I::W;
  const int64_t i0 = blk * kQBlock;
  const int len = static_cast<int>(t.n - i0 < kQBlock ? t.n - i0 : kQBlock);
  int8_t* const mq = static_cast<int8_t*>(t.m) + i0;
  uint8_t* const vq = static_cast<uint8_t*>(t.v) + i0;
  const float md = t.m_scale[blk] / 127.0f, vd = t.v_scale[blk] / 255.0f;
  alignas(64) float mbuf[kQBlock], ubuf[kQBlock];
  const V zero = I::set1(0.0f), vmd = I::set1(md), vvd = I::set1(vd);
  V am = zero, au = zero, bad = zero;  // bad: 0, or NaN once any new m or u is non-finite
  int j = 0;
  for (; j + W <= len; j += W) {
    const V x = I::mul(I::load_i8(mq + j), vmd);
    V m = I::mul(x, I::abs(x));
    const V w = I::mul(I::load_u8(vq + j), vvd);
    const V w2 = I::mul(w, w);
    V v = I::mul(w2, w2), sv;
    q_update<I, GD, OD, DECAY, RARE>(t.p, t.g, t.out, c, f, i0 + j, m, v, sv);
    const V u = I::sqrt(sv);
    const V ra = I::sqrt(I::abs(m));
    I::store(mbuf + j, I::copysign(ra, m));
    I::store(ubuf + j, u);
    am = I::maxf(am, ra);
    au = I::maxf(au, u);
    bad = I::add(bad, I::add(I::mul(ra, zero), I::mul(u, zero)));
  }
  float am_s = 0.0f, au_s = 0.0f, bad_s = 0.0f;
  for (; j < len; ++j) {
    const float x = static_cast<float>(mq[j]) * md;
    float m = x * std::fabs(x);
    const float w = static_cast<float>(vq[j]) * vd;
    const float w2 = w * w;
    float v = w2 * w2, sv;
    q_update<ScalarISA, GD, OD, DECAY, RARE>(t.p, t.g, t.out, cs, f, i0 + j, m, v, sv);
    const float u = std::sqrt(sv);
    const float ra = std::sqrt(std::fabs(m));
    mbuf[j] = std::copysign(ra, m);
    ubuf[j] = u;
    am_s = ScalarISA::maxf(am_s, ra);
    au_s = ScalarISA::maxf(au_s, u);
    bad_s = bad_s + (ra * 0.0f + u * 0.0f);
  }
  alignas(64) float la[W], lu[W], lb[W];
  I::lanes(la, am);
  I::lanes(lu, au);
  I::lanes(lb, bad);
  bool poisoned = std::isnan(bad_s);
  for (int k = 0; k < W; ++k) {
    am_s = ScalarISA::maxf(am_s, la[k]);
    au_s = ScalarISA::maxf(au_s, lu[k]);
    poisoned = poisoned || std::isnan(lb[k]);
  }
  if (poisoned) {
    std::memset(mq, 0, len);
    std::memset(vq, 0, len);
    t.m_scale[blk] = t.v_scale[blk] = std::nanf("");
    return;
  }
  const float im = am_s > 0.0f ? std::fmin(127.0f / am_s, FLT_MAX) : 0.0f;
  const float iu = au_s > 0.0f ? std::fmin(255.0f / au_s, FLT_MAX) : 0.0f;
  const V vim = I::set1(im), viu = I::set1(iu);
  j = 0;
  for (; j + W <= len; j += W) {
    I::store_i8(mq + j, I::mul(I::load(mbuf + j), vim));
    I::store_u8(vq + j, I::mul(I::load(ubuf + j), viu));
  }
  for (; j < len; ++j) {
    ScalarISA::store_i8(mq + j, mbuf[j] * im);
    ScalarISA::store_u8(vq + j, ubuf[j] * iu);
  }
  t.m_scale[blk] = am_s;
  t.v_scale[blk] = au_s;
}

// Blocks [bb, be) of one tensor (bf16 moments: the same element range, block by block).
template <class I, int GD, int OD, bool DECAY, bool RARE>
static void q_loop(const AdamQTask& t, const AdamScalars& s, int64_t bb, int64_t be) {
  const RareFlags f{s.use_mult, s.maximize, s.use_wd, s.lerp_low};
  const Coeffs<I> c(s);
  const Coeffs<ScalarISA> cs(s);
  if (t.mfmt == kMom8) {
    for (int64_t b = bb; b < be; ++b) q8_block<I, GD, OD, DECAY, RARE>(t, c, cs, f, b);
    return;
  }
  const int64_t end = be * kQBlock < t.n ? be * kQBlock : t.n;
  int64_t i = bb * kQBlock;
  for (; i + I::W <= end; i += I::W) bf16m_elems<I, GD, OD, DECAY, RARE>(t, c, f, i);
  for (; i < end; ++i) bf16m_elems<ScalarISA, GD, OD, DECAY, RARE>(t, cs, f, i);
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
