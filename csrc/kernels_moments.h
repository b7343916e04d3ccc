// kernels_moments.h: the Adam update over compressed moments (formats in moments.h), written
// once as templates over the ISA structs of simd.h, like kernels_impl.h (which includes this
// file and provides load_grad, store_out, Coeffs and RareFlags). Same per-element operations in
// the same order as the fp32 kernel, plus the decode before and the encode after:
//   bf16:  m = bf16(m16), v = bf16(v16) ... m16 = rne(m), v16 = rne(v)
//   8bit:  x = q_m * (m_scale / 127);  m = shl1(x) (sign kept);  w = q_v * (v_scale / 255);
//          s = shl1(w), v = s * s  ...  r = shr1(|m_new|) with m_new's sign, u = shr1(sqrt(v_new))
//          (the sqrt is the update's own), block maxima of |r| and u (as integers: the bits of
//          non-negative floats order like the floats, and a non-finite m or v gives bits >=
//          shr1(+inf), so the maxima also find a poisoned block), then q_m = rne(r * min(127 /
//          max|r|, FLT_MAX)), q_v = rne(u * min(255 / max u, FLT_MAX)); the scales are the maxima.
//          shr1/shl1 shift the float's bit pattern by one (moments.h): no sqrt, no division per
//          element (on Zen 3 the divide/sqrt unit, not memory, limited the earlier root codes).
// Everything is elementwise except the two maxima, which are exact in any order, so each ISA's
// lanes compute bit for bit what the scalar reference computes.
//
// Loop structure as adam_loop (kernels_impl.h): pointers, coefficients and flags in locals of the
// loop's own function (a store through p/m/v may alias the task's fields otherwise), DECAY and
// RARE as template parameters; the vector loops software-pipelined (q_pipelined, below), whole
// 64-element groups unrolled with their prefetches in fixed places (q_pipelined_groups). The 8-bit
// two-pass loop is in kernels_moments_q8.h, the ISA integer ops of its codes in simd_q.h.
#pragma once
#include <cfloat>
#include <cstring>
#include <type_traits>

#include "moments.h"
#include "simd_q.h"

namespace offload {

// The pipeline stages below must be inlined into their loops (GCC 12 otherwise leaves some out
// of line, which costs the loop its registers and trips its avx512fintrin.h -Wuninitialized
// false positive).
#define OFFLOAD_QINLINE inline __attribute__((always_inline))

// One vector (or element) between its decode and its encode: the decoded moments go in, the
// new master (before the division's term), new m, new v and sqrt(v) come out of stage A.
template <class I>
struct QVec {
  typename I::V p, m, v, sv;
};

// The fp32 kernel's update (same operations as adam_block in kernels_impl.h) in two stages:
// A, everything up to sqrt(v); B, the division, the master's store and out's (GD/OD as in
// adam_block, kernels_impl.h).
template <class I, int GD, int OD, bool DECAY, bool RARE>
static OFFLOAD_QINLINE void q_stage_a(const float* __restrict p_, const void* __restrict g_, const void* __restrict out_,
                                      const Coeffs<I>& c, RareFlags f, int64_t i, QVec<I>& x) {
  using V = typename I::V;
  V g = load_grad<I, GD>(g_, i);
  if (RARE && f.use_mult) g = I::mul(g, c.mult);
  if (RARE && f.maximize) g = I::neg(g);
  V p = adopt_user_writes<I, OD>(out_, i, I::load(p_ + i));  // kBF16Sync/kF16Sync: common.h
  if (RARE && f.use_wd) g = I::add(g, I::mul(c.wd, p));
  if (DECAY) p = I::mul(p, c.decay);
  if (!RARE || f.lerp_low) {
    x.m = I::add(x.m, I::mul(c.w1, I::sub(g, x.m)));
  } else {
    x.m = I::sub(g, I::mul(I::sub(g, x.m), c.one_minus_w1));
  }
  x.v = I::add(I::mul(x.v, c.beta2), I::mul(I::mul(c.one_minus_beta2, g), g));
  x.sv = I::sqrt(x.v);
  x.p = p;
}

template <class I, int OD>
static OFFLOAD_QINLINE void q_stage_b(float* __restrict p_, void* __restrict out_, const Coeffs<I>& c, int64_t i,
                                      const QVec<I>& x) {
  using V = typename I::V;
  const V denom = I::add(I::mul(x.sv, c.inv_bc2_sqrt), c.eps);
  const V p = I::add(x.p, I::div(I::mul(c.neg_step_size, x.m), denom));
  I::store(p_ + i, p);
  store_out<I, OD>(out_, i, p);
}

// Vectors [i, end) of I::W elements, software-pipelined: stage A of vector k + 1 (with its
// decode) comes before stage B of vector k (with its encode) in program order. Measured on Zen 3
// (bench/moments_ub/): in cache these loops are bound neither by the FP pipes (up to ~12 extra
// shift/shuffle/mul/add/cvt/pack ops per sqrt + div pair issue for free) nor by the divider
// (the fp32 kernel sits at its floor; these take 1.6-2.3x as long) but by latency: ~60 cycles
// of dependent operations per vector (decode -> update -> sqrt -> div -> encode) against an
// out-of-order window of ~100 FP operations. Issuing stage B's operations one vector later, when
// their inputs are ready, lets more vectors overlap (TSC cycles per 8 elements in L2: bf16
// moments 12.3 -> 10.4, with bf16 grad + out 18.7 -> 15.7; 8-bit 15.5 -> 14.1, 22.2 -> 18.9).
// Returns the first element not done. Elementwise, so the results are those of one-at-a-time.
template <class I, class Dec, class StageA, class StageB>
static OFFLOAD_QINLINE int64_t q_pipelined(int64_t i, int64_t end, Dec dec, StageA stage_a, StageB stage_b) {
  constexpr int W = I::W;
  if (i + W > end) return i;
  QVec<I> cur{};
  dec(i, cur);
  stage_a(i, cur);
  for (; i + 2 * W <= end; i += W) {
    QVec<I> nxt{};
    dec(i + W, nxt);
    stage_a(i + W, nxt);
    stage_b(i, cur);
    cur = nxt;
  }
  stage_b(i, cur);
  return i + W;
}

// Elements per group of q_pipelined_groups: one 64-byte line of an 8-bit stream, a quarter block.
constexpr int kQGroup = 64;

// q_pipelined over `groups` whole groups of kQGroup elements from i, unrolled by the group's
// vectors: two QVecs alternate (no copy per vector) and each software prefetch has a fixed vector
// of the group (pf(i, u): vector u's prefetches for the group at element i; no branch per stream
// and vector). The caller owns the groups and every line their prefetches ask for. gate(i): a
// flag per group, taken before any of the group's vectors is read, passed to stage A of each of
// them (q_group_quick). Same operations per element as q_pipelined, so the same results.
template <class I, class Dec, class StageA, class StageB, class Pf, class Gate>
static OFFLOAD_QINLINE void q_pipelined_groups(int64_t i, int64_t groups, Dec dec, StageA stage_a, StageB stage_b, Pf pf,
                                               Gate gate) {
  constexpr int W = I::W;
  constexpr int GV = kQGroup / W;  // vectors per group
  static_assert(GV >= 2 && GV % 2 == 0, "two alternating vectors per group");
  if (groups <= 0) return;
  QVec<I> x[2]{};
  bool flag = gate(i);
  dec(i, x[0]);
  stage_a(i, x[0], flag);
  for (int64_t k = 0; k < groups; ++k, i += kQGroup) {
    const bool more = k + 1 < groups;
    const bool next_flag = more && gate(i + kQGroup);
#pragma GCC unroll 16
    for (int u = 0; u < GV; ++u) {
      pf(i, u);
      if (u + 1 < GV || more) {
        dec(i + (u + 1) * W, x[(u + 1) & 1]);
        stage_a(i + (u + 1) * W, x[(u + 1) & 1], u + 1 < GV ? flag : next_flag);
      }
      stage_b(i + u * W, x[u & 1]);
    }
    flag = next_flag;
  }
}

// The prefetches of one stream (SIZE-byte elements) that fall to vector u of a group at element
// i: each line start of the group, kQPrefetchAhead elements ahead, in the vector holding it,
// moved PHASE vectors on (so that the streams' prefetches spread over the group's vectors).
template <int W, int SIZE, bool WRITE, int PHASE>
static OFFLOAD_QINLINE void q_prefetch_group(const void* base, int64_t i, int u) {
  constexpr int kLine = 64 / SIZE;  // elements per line
  constexpr int GV = kQGroup / W;
#pragma GCC unroll 16
  for (int e = 0; e < kQGroup; e += kLine)
    if ((e / W + PHASE) % GV == u)
      __builtin_prefetch(static_cast<const char*>(base) + (i + e + kQPrefetchAhead) * SIZE, WRITE ? 1 : 0, 3);
}

// Every stream's prefetches for vector u of a group (the streams of q_prefetch_streams).
template <int W, int GD, int OD, int MSIZE>
static OFFLOAD_QINLINE void q_prefetch_group_streams(const float* p, const void* g, const void* out, const void* m,
                                                     const void* v, int64_t i, int u) {
  constexpr int GV = kQGroup / W;
  q_prefetch_group<W, 4, true, 0>(p, i, u);
  if (g) q_prefetch_group<W, GD == kF32 ? 4 : 2, false, 1>(g, i, u);
  if constexpr (OD != kNone) q_prefetch_group<W, OD == kF32 ? 4 : 2, true, 0>(out, i, u);
  q_prefetch_group<W, MSIZE, true, 1>(m, i, u);
  q_prefetch_group<W, MSIZE, true, GV / 2 + 1>(v, i, u);
}

// Software prefetch kQPrefetchAhead elements ahead, one stream of SIZE-byte elements: one
// prefetch per 64-byte line (in the vector whose elements start it), none at or past `limit`
// (the end of the range the loop owns). Measured with bench/moments_ub (Zen 3, 32M elements out
// of cache, fp32 grads, with and without in the same process, five such runs): the 8-bit step's
// time 11 % less to 1 % more at one thread (median 7 % less), 2-35 % less at two (median 20 %);
// bf16 moments 20 % less to 12 % more (median 4 % less); 512, 1024 and 2048 elements ahead and
// locality hints 0-3 within noise of each other. In cache it costs ~10 % (L2: 8-bit 20.5 -> 22.4
// TSC cycles per 8 elements); one burst of all streams' lines per 64 elements (one branch per
// vector) was 4-8 % cheaper in cache but slower out of cache in the shipped bench (8-bit, fp32
// grads, 1 thread: 1.16-1.39x the fp32 step in 5 runs against 1.32-1.50x in 2 interleaved ones).
// These loops do about twice the fp32 kernel's operations per element, so the out-of-order window
// fills before the hardware prefetchers have the next lines in flight; on Zen 3 the fp32 kernel
// (at its probe) gained nothing from the same prefetch, on the Xeon it does (kernels_impl.h).
// Without it the Xeon's 8-bit step was 1.5x slower (20.3 vs 13.7 cycles per 8 elements).
template <int W, int SIZE, bool WRITE>  // kQPrefetchAhead: kernels_impl.h
static OFFLOAD_QINLINE void q_prefetch(const void* base, int64_t k, int64_t limit) {
  constexpr int64_t kLine = 64 / SIZE;  // elements per line
  if ((k & (kLine - 1)) < W && k + kQPrefetchAhead < limit)
    __builtin_prefetch(static_cast<const char*>(base) + (k + kQPrefetchAhead) * SIZE, WRITE ? 1 : 0, 3);
}

// Every stream of a compressed-moment loop at vector k: master, gradient (if g is not null: not
// for a chunk that kernels_dtype.h widened into L1), the low-precision copy of the weights when
// there is one (written; also read for kBF16Sync / kF16Sync), and both moments (MSIZE bytes per
// element: 2 for bf16, 1 for 8-bit; the 8-bit scales are per block).
template <int W, int GD, int OD, int MSIZE>
static OFFLOAD_QINLINE void q_prefetch_streams(const float* p, const void* g, const void* out, const void* m,
                                               const void* v, int64_t k, int64_t limit) {
  q_prefetch<W, 4, true>(p, k, limit);
  if (g) q_prefetch<W, GD == kF32 ? 4 : 2, false>(g, k, limit);
  if constexpr (OD != kNone) q_prefetch<W, OD == kF32 ? 4 : 2, true>(out, k, limit);
  q_prefetch<W, MSIZE, true>(m, k, limit);
  q_prefetch<W, MSIZE, true>(v, k, limit);
}

// Both bf16 moments of W elements, round to nearest even.
template <class I>
static OFFLOAD_QINLINE void bf16m_store(uint16_t* __restrict m16, uint16_t* __restrict v16, int64_t i, const QVec<I>& x) {
#if defined(__AVX2__)
  if constexpr (std::is_same_v<I, Avx2ISA>) {
    QOps<I>::store2_bf16(m16 + i, v16 + i, x.m, x.v);
    return;
  }
#endif
  I::store_bf16(m16 + i, x.m);
  I::store_bf16(v16 + i, x.v);
}

// One thread's share of one compressed-moment tensor, as the loops see it: every pointer at the
// share's first element (or at the first element of a chunk of it, kernels_dtype.h), n the
// elements from there to the tensor's end (the last block's length), lim the end of the share
// (no prefetch past it), g and out the gradient and weight copy from there on (dtypes: the loop's
// GD/OD), gpf g if its lines are to be prefetched (the caller's array), else null (a chunk that
// kernels_dtype.h widened into L1).
struct QChunk {
  float* p;
  void* m;
  void* v;
  float* msc;  // 8-bit: the scales of the first block on, else null
  float* vsc;
  const void* g;
  void* out;
  const void* gpf;
  int64_t n, lim;
};

// Elements [begin, end) of one tensor with bf16 moments (blocks only matter to the partition).
template <class I, int GD, int OD, bool DECAY, bool RARE>
static void bf16m_loop(const QChunk& q, const AdamScalars& s, int64_t begin, int64_t end) {
  float* const __restrict p = q.p;
  uint16_t* const __restrict m16 = static_cast<uint16_t*>(q.m);
  uint16_t* const __restrict v16 = static_cast<uint16_t*>(q.v);
  const void* const __restrict g = q.g;
  void* const __restrict out = q.out;
  const void* const gpf = q.gpf;
  const int64_t lim = q.lim;
  const RareFlags f{s.use_mult, s.maximize, s.use_wd, s.lerp_low};
  const Coeffs<I> c(s);
  int64_t i = begin;
  if constexpr (I::W > 1) {
    // whole groups while their prefetches stay below lim, then vector by vector
    const int64_t room = (lim - i - kQPrefetchAhead) / kQGroup, whole = (end - i) / kQGroup;
    const int64_t groups = room <= 0 ? 0 : (room < whole ? room : whole);
    // `n` groups from element `at`, stage A as with output D (OD, or kBF16 where no lane has a write)
    auto run = [&](auto d, int64_t at, int64_t n) {
      constexpr int D = decltype(d)::value;
      q_pipelined_groups<I>(
          at, n,
          [&](int64_t k, QVec<I>& x) {
            x.m = I::load_bf16(m16 + k);
            x.v = I::load_bf16(v16 + k);
          },
          [&](int64_t k, QVec<I>& x, bool) { q_stage_a<I, GD, D, DECAY, RARE>(p, g, out, c, f, k, x); },
          [&](int64_t k, const QVec<I>& x) { q_stage_b<I, OD>(p, out, c, k, x); bf16m_store<I>(m16, v16, k, x); },
          [&](int64_t k, int u) { q_prefetch_group_streams<I::W, GD, OD, 2>(p, gpf, out, m16, v16, k, u); },
          [](int64_t) { return false; });
    };
    if constexpr (OD == kBF16Sync && I::kQuickBF16Sync) {
      // a bf16 parameter: runs of kRun groups (1024 elements), each tested at once (simd.h
      // bf16_quick_in_sync) and run without the per-lane check where that clears it. Zen 3, 1 / 2
      // threads out of cache: 20.6 -> 19.4 and 21.5 -> 20.5 / 11.8 -> 11.1 TSC cycles per 8
      // elements (bench/moments_ub); runs of 4 groups gained ~1 % in L2. A flag per group, as the
      // 8-bit loop takes, put both stage A variants in this loop's unrolled groups: slower
      constexpr int64_t kRun = 16;
      for (int64_t k = 0; k < groups; k += kRun) {
        const int64_t at = i + k * kQGroup, n = groups - k < kRun ? groups - k : kRun;
        if (n == kRun && I::template bf16_quick_in_sync<kRun * kQGroup>(p + at, static_cast<const uint16_t*>(out) + at))
          run(std::integral_constant<int, kBF16>{}, at, n);
        else
          run(std::integral_constant<int, OD>{}, at, n);
      }
    } else {
      run(std::integral_constant<int, OD>{}, i, groups);
    }
    i += groups * kQGroup;
    i = q_pipelined<I>(
        i, end,
        [&](int64_t k, QVec<I>& x) {
          q_prefetch_streams<I::W, GD, OD, 2>(p, gpf, out, m16, v16, k, lim);
          x.m = I::load_bf16(m16 + k);
          x.v = I::load_bf16(v16 + k);
        },
        [&](int64_t k, QVec<I>& x) { q_stage_a<I, GD, OD, DECAY, RARE>(p, g, out, c, f, k, x); },
        [&](int64_t k, const QVec<I>& x) { q_stage_b<I, OD>(p, out, c, k, x); bf16m_store<I>(m16, v16, k, x); });
  }
  if (i < end) {
    using S = ScalarISA;
    const Coeffs<S> cs(s);
    for (; i < end; ++i) {
      QVec<S> x{};
      x.m = S::load_bf16(m16 + i);
      x.v = S::load_bf16(v16 + i);
      q_stage_a<S, GD, OD, DECAY, RARE>(p, g, out, cs, f, i, x);
      q_stage_b<S, OD>(p, out, cs, i, x);
      bf16m_store<S>(m16, v16, i, x);
    }
  }
}

}  // namespace offload

#include "kernels_moments_q8.h"  // the 8-bit loop: uses the stages above

namespace offload {

// Blocks [bb, be) of one tensor from q's first element (bf16 moments: the same element range).
template <class I, int GD, int OD, bool DECAY, bool RARE, bool Q8>
static void q_loop(const QChunk& q, const AdamScalars& s, int64_t bb, int64_t be) {
  if constexpr (Q8) {
    q8_loop<I, GD, OD, DECAY, RARE>(q, s, bb, be);
  } else {
    const int64_t end = be * kQBlock < q.n ? be * kQBlock : q.n;
    bf16m_loop<I, GD, OD, DECAY, RARE>(q, s, bb * kQBlock, end);
  }
}

using QLoop = void (*)(const QChunk&, const AdamScalars&, int64_t, int64_t);

template <class I, int GD, int OD, bool Q8>
static QLoop q_loop_for(const AdamScalars& s) {
  const bool rare = s.use_mult || s.maximize || s.use_wd || !s.lerp_low;
  switch ((s.use_decay ? 2 : 0) | (rare ? 1 : 0)) {
    case 0: return &q_loop<I, GD, OD, false, false, Q8>;
    case 1: return &q_loop<I, GD, OD, false, true, Q8>;
    case 2: return &q_loop<I, GD, OD, true, false, Q8>;
    default: return &q_loop<I, GD, OD, true, true, Q8>;
  }
}

// The fused loop of the task's dtype pair and format (fused_pair, kernels_dtype.h), or null.
template <class I, bool Q8>
static QLoop q_fused_for(int64_t gdtype, int64_t odtype, const AdamScalars& s) {
  const FusedPair pair = fused_pair<I>(gdtype, odtype);
  if (pair == kPairF32) return q_loop_for<I, kF32, kNone, Q8>(s);
  if constexpr (I::W > 1) {  // (no other pair is fused on the scalar ISA)
    if (pair == kPairF32Out) return q_loop_for<I, kF32, kF32, Q8>(s);
    if (pair == kPairBF16) return q_loop_for<I, kBF16, kBF16, Q8>(s);
    if (pair == kPairBF16Param) return q_loop_for<I, kBF16, kBF16Sync, Q8>(s);
  }
  return nullptr;
}

// Entry of the kernel table: blocks [bb, be) of one tensor with compressed moments, in one fused
// pass for the dtype pairs of fused_pair, else through the dtype passes kDChunk elements (whole
// blocks) at a time, as adam_range (kernels_impl.h).
template <class I>
static void adam_q_range(const AdamQTask& t, const AdamScalars& s, int64_t bb, int64_t be) {
  if (bb >= be) return;
  const bool q8 = t.mfmt == kMom8;
  const int64_t msize = q8 ? 1 : 2;
  const int64_t e = be * kQBlock < t.n ? be * kQBlock : t.n;
  auto chunk = [&](int64_t c, const void* g, void* out, bool gpf) {
    const int64_t blk = c / kQBlock;
    return QChunk{t.p + c, static_cast<char*>(t.m) + c * msize, static_cast<char*>(t.v) + c * msize,
                  t.m_scale ? t.m_scale + blk : nullptr, t.v_scale ? t.v_scale + blk : nullptr, g, out,
                  gpf ? g : nullptr, t.n - c, e - c};
  };
  const QLoop fused = q8 ? q_fused_for<I, true>(t.gdtype, t.odtype, s) : q_fused_for<I, false>(t.gdtype, t.odtype, s);
  if (fused) {
    const int64_t c = bb * kQBlock;
    fused(chunk(c, elem_at(t.g, t.gdtype, c), elem_at(t.out, t.odtype, c), true), s, 0, be - bb);
    return;
  }
  const QLoop loop = q8 ? q_loop_for<I, kF32, kNone, true>(s) : q_loop_for<I, kF32, kNone, false>(s);
  const float* const stores[] = {t.p + bb * kQBlock};
  // chunks start on block boundaries (kDChunk is a whole number of blocks); the last may end in a partial block
  through_passes<I>(t.p, t.g, t.gdtype, t.out, t.odtype, bb * kQBlock, e, stores, 1,
                    [&](int64_t c, int64_t n, const float* g) {
                      loop(chunk(c, g, nullptr, t.gdtype == kF32), s, 0, (n + kQBlock - 1) / kQBlock);
                    });
}

}  // namespace offload

#undef OFFLOAD_QINLINE