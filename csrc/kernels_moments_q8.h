// kernels_moments_q8.h: the two-pass 8-bit moment loop of the compressed-moment Adam update
// (formats in moments.h): pass 1 decodes a 256-element block, runs the update and keeps the new
// moments in a scratch with their block maxima; pass 2 writes the scales and the codes. Included
// by kernels_moments.h, whose stages (q_stage_a/b), pipelining and prefetch helpers it uses.
#pragma once

namespace offload {

// Stage A with a bf16 parameter that is the kernel's output (kBF16Sync): as kBF16, without the
// per-lane adoption check, where `quick` says the vector's group passed I::bf16_quick_in_sync
// (q_group_quick); for every other OD, or without a quick test, stage A as it is.
template <class I, int GD, int OD, bool DECAY, bool RARE>
static OFFLOAD_QINLINE void q_stage_a_gated(const float* __restrict p_, const void* __restrict g_,
                                            const void* __restrict out_, const Coeffs<I>& c, RareFlags f, int64_t i,
                                            QVec<I>& x, bool quick) {
  if constexpr (OD == kBF16Sync && I::kQuickBF16Sync) {
    if (quick) return q_stage_a<I, GD, kBF16, DECAY, RARE>(p_, g_, out_, c, f, i, x);
  }
  q_stage_a<I, GD, OD, DECAY, RARE>(p_, g_, out_, c, f, i, x);
}

// The gate of q_pipelined_groups for a loop with output OD: with kBF16Sync on an ISA with a quick
// test, whether the kQGroup elements from i have no user write to adopt (simd.h
// bf16_quick_in_sync; false sends them through the exact per-lane check); otherwise false.
template <class I, int OD>
static OFFLOAD_QINLINE bool q_group_quick(const float* p, const void* out, int64_t i) {
  if constexpr (OD == kBF16Sync && I::kQuickBF16Sync)
    return I::template bf16_quick_in_sync<kQGroup>(p + i, static_cast<const uint16_t*>(out) + i);
  else
    return false;
}

// 8-bit decode of W elements (j: index in the block) and encode into the block's scratch:
// r = shr1(|m|) with m's sign, u = shr1(sqrt(v)), and the running maxima of |r| and u (bits).
template <class I>
static OFFLOAD_QINLINE void q8_decode(const int8_t* __restrict mq, const uint8_t* __restrict vq, int64_t j, typename I::V vmd,
                             typename I::V vvd, QVec<I>& x) {
  using Q = QOps<I>;
  x.m = Q::flt(Q::shl1_keep_sign(Q::bits(I::mul(I::load_i8(mq + j), vmd))));
  const typename I::V s = Q::flt(Q::shl1(Q::bits(I::mul(I::load_u8(vq + j), vvd))));
  x.v = I::mul(s, s);
}

template <class I>
static OFFLOAD_QINLINE void q8_encode(float* __restrict rbuf, float* __restrict ubuf, int64_t j, const QVec<I>& x,
                             typename QOps<I>::Vi& am, typename QOps<I>::Vi& au) {
  using Q = QOps<I>;
  const auto mb = Q::bits(x.m);
  const auto ub = Q::shr1(Q::bits(x.sv));
  I::store(rbuf + j, Q::flt(Q::shr1_keep_sign(mb)));
  I::store(ubuf + j, Q::flt(ub));
  am = Q::maxu(am, Q::abs(mb));  // max |m| bits: shr1 is monotonic, so shr1(max) = max |r| (q8_pass1)
  au = Q::maxu(au, ub);
}

// A block between its two passes: codes of the new moments in the scratch, their maxima.
struct Q8Pending {
  int64_t blk;
  int len;
  uint32_t am, au;  // bits of max |r| and max u
};

// Pass 1 of one 256-element block (or the shorter last one) of an 8-bit tensor.
template <class I, int GD, int OD, bool DECAY, bool RARE>
static inline Q8Pending q8_pass1(float* __restrict p, const int8_t* __restrict mq0, const uint8_t* __restrict vq0,
                                 const float* __restrict msc, const float* __restrict vsc, const void* __restrict g,
                                 void* __restrict out, const void* gpf, int64_t n, int64_t lim, const Coeffs<I>& c, const Coeffs<ScalarISA>& cs,
                                 RareFlags f, int64_t blk, float* __restrict rbuf, float* __restrict ubuf) {
  using V = typename I::V;
  using Q = QOps<I>;
  constexpr int W = I::W;
  const int64_t i0 = blk * kQBlock;
  const int len = static_cast<int>(n - i0 < kQBlock ? n - i0 : kQBlock);
  const int8_t* const mq = mq0 + i0;
  const uint8_t* const vq = vq0 + i0;
  const float md = msc[blk] / 127.0f, vd = vsc[blk] / 255.0f;
  const V vmd = I::set1(md), vvd = I::set1(vd);
  typename Q::Vi am = Q::zero(), au = Q::zero();
  int64_t j = 0;  // index in the block; the element is i0 + j
  if constexpr (W > 1) {
    if (len == kQBlock && i0 + kQBlock + kQPrefetchAhead <= lim) {
      q_pipelined_groups<I>(
          0, kQBlock / kQGroup, [&](int64_t k, QVec<I>& x) { q8_decode<I>(mq, vq, k, vmd, vvd, x); },
          [&](int64_t k, QVec<I>& x, bool quick) {
            q_stage_a_gated<I, GD, OD, DECAY, RARE>(p, g, out, c, f, i0 + k, x, quick);
          },
          [&](int64_t k, const QVec<I>& x) { q_stage_b<I, OD>(p, out, c, i0 + k, x); q8_encode<I>(rbuf, ubuf, k, x, am, au); },
          [&](int64_t k, int u) { q_prefetch_group_streams<W, GD, OD, 1>(p, gpf, out, mq0, vq0, i0 + k, u); },
          // a bf16 parameter: the per-lane check only in groups the quick test does not clear (Zen 3,
          // 1 thread: 25.1 -> 23.0 TSC cycles per 8 elements in L2, 25.3 -> 22.9 out of cache)
          [&](int64_t k) { return q_group_quick<I, OD>(p, out, i0 + k); });
      j = kQBlock;
    }
    j = q_pipelined<I>(
        j, len,
        [&](int64_t k, QVec<I>& x) {
          q_prefetch_streams<W, GD, OD, 1>(p, gpf, out, mq0, vq0, i0 + k, lim);
          q8_decode<I>(mq, vq, k, vmd, vvd, x);
        },
        [&](int64_t k, QVec<I>& x) { q_stage_a<I, GD, OD, DECAY, RARE>(p, g, out, c, f, i0 + k, x); },
        [&](int64_t k, const QVec<I>& x) { q_stage_b<I, OD>(p, out, c, i0 + k, x); q8_encode<I>(rbuf, ubuf, k, x, am, au); });
  }
  using S = ScalarISA;
  uint32_t am_s = 0, au_s = 0;
  for (; j < len; ++j) {
    QVec<S> x{};
    q8_decode<S>(mq, vq, j, md, vd, x);
    q_stage_a<S, GD, OD, DECAY, RARE>(p, g, out, cs, f, i0 + j, x);
    q_stage_b<S, OD>(p, out, cs, i0 + j, x);
    q8_encode<S>(rbuf, ubuf, j, x, am_s, au_s);
  }
  alignas(64) uint32_t la[W], lu[W];
  Q::lanes(la, am);
  Q::lanes(lu, au);
  for (int k = 0; k < W; ++k) {
    am_s = la[k] > am_s ? la[k] : am_s;
    au_s = lu[k] > au_s ? lu[k] : au_s;
  }
  return Q8Pending{blk, len, am_s >> 1, au_s};
}

// Pass 2: the scales and the bytes of a block from its scratch.
template <class I>
static inline void q8_pass2(int8_t* __restrict mq0, uint8_t* __restrict vq0, float* __restrict msc,
                            float* __restrict vsc, const Q8Pending& b, const float* __restrict rbuf,
                            const float* __restrict ubuf) {
  using V = typename I::V;
  using Q = QOps<I>;
  constexpr int W = I::W;
  int8_t* const mq = mq0 + b.blk * kQBlock;
  uint8_t* const vq = vq0 + b.blk * kQBlock;
  const int len = b.len;
  if (b.am >= kQPoisonBits || b.au >= kQPoisonBits) {  // a non-finite new m or v in the block
    std::memset(mq, 0, len);
    std::memset(vq, 0, len);
    msc[b.blk] = vsc[b.blk] = bits_f32(kQPoisonScale);
    return;
  }
  // |r| * im <= 127 (1 + 2^-23) and u * iu <= 255 (1 + 2^-23): every code is in range, so the
  // reference's clamp never acts and saturating packs give the same bytes.
  const float mmax = bits_f32(b.am), umax = bits_f32(b.au);
  const float im = mmax > 0.0f ? std::fmin(127.0f / mmax, FLT_MAX) : 0.0f;
  const float iu = umax > 0.0f ? std::fmin(255.0f / umax, FLT_MAX) : 0.0f;
  const V vim = I::set1(im), viu = I::set1(iu);
  int j = 0;
  if constexpr (!std::is_same_v<I, ScalarISA>) {
    for (; j + 4 * W <= len; j += 4 * W) {
      Q::store4_i8(mq + j, I::mul(I::load(rbuf + j), vim), I::mul(I::load(rbuf + j + W), vim),
                   I::mul(I::load(rbuf + j + 2 * W), vim), I::mul(I::load(rbuf + j + 3 * W), vim));
      Q::store4_u8(vq + j, I::mul(I::load(ubuf + j), viu), I::mul(I::load(ubuf + j + W), viu),
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
  msc[b.blk] = mmax;
  vsc[b.blk] = umax;
}

// Blocks [bb, be) of an 8-bit tensor from q's first element, software-pipelined: pass 2 of block
// b runs after pass 1 of block b + 1 (two scratch pairs), so the block's reduction and two
// divisions are off the critical path. Blocks are independent, so the result is the same as block
// by block.
template <class I, int GD, int OD, bool DECAY, bool RARE>
static void q8_loop(const QChunk& q, const AdamScalars& s, int64_t bb, int64_t be) {
  float* const __restrict p = q.p;
  int8_t* const __restrict mq = static_cast<int8_t*>(q.m);
  uint8_t* const __restrict vq = static_cast<uint8_t*>(q.v);
  float* const __restrict msc = q.msc;
  float* const __restrict vsc = q.vsc;
  const void* const __restrict g = q.g;
  void* const __restrict out = q.out;
  const void* const gpf = q.gpf;
  const int64_t n = q.n, lim = q.lim;
  const RareFlags f{s.use_mult, s.maximize, s.use_wd, s.lerp_low};
  const Coeffs<I> c(s);
  const Coeffs<ScalarISA> cs(s);
  alignas(64) float rbuf[2][kQBlock], ubuf[2][kQBlock];
  if (bb >= be) return;
  Q8Pending prev = q8_pass1<I, GD, OD, DECAY, RARE>(p, mq, vq, msc, vsc, g, out, gpf, n, lim, c, cs, f, bb, rbuf[0], ubuf[0]);
  for (int64_t b = bb + 1; b < be; ++b) {
    const int k = static_cast<int>((b - bb) & 1);
    const Q8Pending cur = q8_pass1<I, GD, OD, DECAY, RARE>(p, mq, vq, msc, vsc, g, out, gpf, n, lim, c, cs, f, b, rbuf[k], ubuf[k]);
    q8_pass2<I>(mq, vq, msc, vsc, prev, rbuf[k ^ 1], ubuf[k ^ 1]);
    prev = cur;
  }
  const int k = static_cast<int>((be - 1 - bb) & 1);
  q8_pass2<I>(mq, vq, msc, vsc, prev, rbuf[k], ubuf[k]);
}

}  // namespace offload
