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
// 64-element groups unrolled with their prefetches in fixed places (q_pipelined_groups).
#pragma once
#include <cfloat>
#include <cstring>
#include <type_traits>

#include "moments.h"

namespace offload {

// The pipeline stages below must be inlined into their loops (GCC 12 otherwise leaves some out
// of line, which costs the loop its registers and trips its avx512fintrin.h -Wuninitialized
// false positive).
#define OFFLOAD_QINLINE inline __attribute__((always_inline))

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

// One vector (or element) between its decode and its encode: the decoded moments go in, the
// new master (before the division's term), new m, new v and sqrt(v) come out of stage A.
template <class I>
struct QVec {
  typename I::V p, m, v, sv;
};

// The fp32 kernel's update (same operations as adam_block in kernels_impl.h) in two stages:
// A, everything up to sqrt(v); B, the division, the master's store and out's.
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
// and vector). The caller owns the groups and every line their prefetches ask for. Same
// operations per element as q_pipelined, so the same results.
template <class I, class Dec, class StageA, class StageB, class Pf>
static OFFLOAD_QINLINE void q_pipelined_groups(int64_t i, int64_t groups, Dec dec, StageA stage_a, StageB stage_b, Pf pf) {
  constexpr int W = I::W;
  constexpr int GV = kQGroup / W;  // vectors per group
  static_assert(GV >= 2 && GV % 2 == 0, "two alternating vectors per group");
  if (groups <= 0) return;
  QVec<I> x[2]{};
  dec(i, x[0]);
  stage_a(i, x[0]);
  for (int64_t k = 0; k < groups; ++k, i += kQGroup) {
    const bool more = k + 1 < groups;
#pragma GCC unroll 8
    for (int u = 0; u < GV; ++u) {
      pf(i, u);
      if (u + 1 < GV || more) {
        dec(i + (u + 1) * W, x[(u + 1) & 1]);
        stage_a(i + (u + 1) * W, x[(u + 1) & 1]);
      }
      stage_b(i + u * W, x[u & 1]);
    }
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
  q_prefetch_group<W, GD == kF32 ? 4 : 2, false, 1>(g, i, u);
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

// Every stream of a compressed-moment loop at vector k: master, gradient, the low-precision copy
// of the weights when there is one (written; also read for kBF16Sync / kF16Sync), and both
// moments (MSIZE bytes per element: 2 for bf16, 1 for 8-bit; the 8-bit scales are per block).
template <int W, int GD, int OD, int MSIZE>
static OFFLOAD_QINLINE void q_prefetch_streams(const float* p, const void* g, const void* out, const void* m,
                                               const void* v, int64_t k, int64_t limit) {
  q_prefetch<W, 4, true>(p, k, limit);
  q_prefetch<W, GD == kF32 ? 4 : 2, false>(g, k, limit);
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

// Elements [begin, end) of one tensor with bf16 moments (blocks only matter to the partition).
template <class I, int GD, int OD, bool DECAY, bool RARE>
static void bf16m_loop(const AdamQTask& t, const AdamScalars& s, int64_t begin, int64_t end) {
  float* const __restrict p = t.p;
  uint16_t* const __restrict m16 = static_cast<uint16_t*>(t.m);
  uint16_t* const __restrict v16 = static_cast<uint16_t*>(t.v);
  const void* const __restrict g = t.g;
  void* const __restrict out = t.out;
  const RareFlags f{s.use_mult, s.maximize, s.use_wd, s.lerp_low};
  const Coeffs<I> c(s);
  int64_t i = begin;
  if constexpr (I::W > 1) {
    const int64_t groups = end - i - kQPrefetchAhead >= kQGroup ? (end - i - kQPrefetchAhead) / kQGroup : 0;
    q_pipelined_groups<I>(
        i, groups,
        [&](int64_t k, QVec<I>& x) {
          x.m = I::load_bf16(m16 + k);
          x.v = I::load_bf16(v16 + k);
        },
        [&](int64_t k, QVec<I>& x) { q_stage_a<I, GD, OD, DECAY, RARE>(p, g, out, c, f, k, x); },
        [&](int64_t k, const QVec<I>& x) { q_stage_b<I, OD>(p, out, c, k, x); bf16m_store<I>(m16, v16, k, x); },
        [&](int64_t k, int u) { q_prefetch_group_streams<I::W, GD, OD, 2>(p, g, out, m16, v16, k, u); });
    i += groups * kQGroup;
    i = q_pipelined<I>(
        i, end,
        [&](int64_t k, QVec<I>& x) {
          q_prefetch_streams<I::W, GD, OD, 2>(p, g, out, m16, v16, k, end);
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
                                 void* __restrict out, int64_t n, int64_t lim, const Coeffs<I>& c, const Coeffs<ScalarISA>& cs,
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
          [&](int64_t k, QVec<I>& x) { q_stage_a<I, GD, OD, DECAY, RARE>(p, g, out, c, f, i0 + k, x); },
          [&](int64_t k, const QVec<I>& x) { q_stage_b<I, OD>(p, out, c, i0 + k, x); q8_encode<I>(rbuf, ubuf, k, x, am, au); },
          [&](int64_t k, int u) { q_prefetch_group_streams<W, GD, OD, 1>(p, g, out, mq0, vq0, i0 + k, u); });
      j = kQBlock;
    }
    j = q_pipelined<I>(
        j, len,
        [&](int64_t k, QVec<I>& x) {
          q_prefetch_streams<W, GD, OD, 1>(p, g, out, mq0, vq0, i0 + k, lim);
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

// Blocks [bb, be) of an 8-bit tensor, software-pipelined: pass 2 of block b runs after pass 1
// of block b + 1 (two scratch pairs), so the block's reduction and two divisions are off the
// critical path. Blocks are independent, so the result is the same as block by block.
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
  const int64_t lim = be * kQBlock < n ? be * kQBlock : n;  // end of this range (for the prefetches)
  const RareFlags f{s.use_mult, s.maximize, s.use_wd, s.lerp_low};
  const Coeffs<I> c(s);
  const Coeffs<ScalarISA> cs(s);
  alignas(64) float rbuf[2][kQBlock], ubuf[2][kQBlock];
  if (bb >= be) return;
  Q8Pending prev = q8_pass1<I, GD, OD, DECAY, RARE>(p, mq, vq, msc, vsc, g, out, n, lim, c, cs, f, bb, rbuf[0], ubuf[0]);
  for (int64_t b = bb + 1; b < be; ++b) {
    const int k = static_cast<int>((b - bb) & 1);
    const Q8Pending cur = q8_pass1<I, GD, OD, DECAY, RARE>(p, mq, vq, msc, vsc, g, out, n, lim, c, cs, f, b, rbuf[k], ubuf[k]);
    q8_pass2<I>(mq, vq, msc, vsc, prev, rbuf[k ^ 1], ubuf[k ^ 1]);
    prev = cur;
  }
  const int k = static_cast<int>((be - 1 - bb) & 1);
  q8_pass2<I>(mq, vq, msc, vsc, prev, rbuf[k], ubuf[k]);
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
    case kBF16Sync: return q_range_t<I, GD, kBF16Sync>(t, s, bb, be);
    case kF16Sync: return q_range_t<I, GD, kF16Sync>(t, s, bb, be);
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

#undef OFFLOAD_QINLINE
