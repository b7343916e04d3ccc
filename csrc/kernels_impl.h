// kernels_impl.h: the Adam/AdamW update and the gradient statistics pass, written once as
// templates over an ISA struct from simd.h. Included by kernels_{scalar,avx2,avx512}.cpp, each
// compiled with its own instruction-set flags, which instantiate it via OFFLOAD_DEFINE_ISA.
//
// Per element (the order of torch.optim.adam._single_tensor_adam, one fp32 op at a time):
//   g  = grad * mult                 (mult folds loss-scale unscaling and clipping)
//   g  = -g                          (maximize)
//   g  = g + wd * p                  (Adam: L2 penalty)      | p = p * (1 - lr*wd) (AdamW)
//   m  = lerp(m, g, 1 - beta1)
//   v  = v * beta2 + ((1 - beta2) * g) * g
//   vm = max(vmax, v)                (amsgrad)
//   p  = p + (-step_size * m) / (sqrt(v or vm) * (1 / sqrt(1 - beta2^t)) + eps)
//   out = round_to_nearest_even(p)   (optional bf16/fp16 copy for the device)
//   (with kBF16Sync/kF16Sync, first: p = out wherever out != round(p): a user's write, common.h)
//
// The one departure from torch's formula: torch divides sqrt(v) by sqrt(1 - beta2^t); we
// multiply by its reciprocal (computed in double, rounded to fp32 once per call). On Zen 3 the
// divider was the compute limit (sqrt + 2 divisions per vector: ~2000 Mparam/s per core in
// cache, ~2750 with one), and a single thread at full memory bandwidth needs more than 2000.
// Accuracy: over 200 steps of 200k elements the float64 error is 0.999-1.000x torch's (folding
// sqrt(1 - beta2^t) into step size and eps instead measured 1.001x); tests/test_kernel.py
// checks it stays within torch's own.
#pragma once
#include "kernels.h"
#include "simd.h"

namespace offload {

template <class I, int GD>
static inline typename I::V load_grad(const void* g, int64_t i) {
  if constexpr (GD == kF32) return I::load(static_cast<const float*>(g) + i);
  else if constexpr (GD == kBF16) return I::load_bf16(static_cast<const uint16_t*>(g) + i);
  else return I::load_f16(static_cast<const uint16_t*>(g) + i);
}

template <class I, int OD>
static inline void store_out(void* out, int64_t i, typename I::V x) {
  if constexpr (OD == kBF16 || OD == kBF16Sync) I::store_bf16(static_cast<uint16_t*>(out) + i, x);
  else if constexpr (OD == kF16 || OD == kF16Sync) I::store_f16(static_cast<uint16_t*>(out) + i, x);
  else if constexpr (OD == kF32) I::store(static_cast<float*>(out) + i, x);
}

// kBF16Sync / kF16Sync (common.h): out is the user's parameter. Lanes whose 16-bit pattern is not
// round(master) were written by the user since the last step: the master takes that value.
// Both sides are widened exactly and compared as bit patterns (so -0 and NaN payloads count).
template <class I, int OD>
static inline typename I::V adopt_user_writes(const void* out, int64_t i, typename I::V p) {
  if constexpr (OD == kBF16Sync || OD == kF16Sync) {
    constexpr int LD = OD == kBF16Sync ? kBF16 : kF16;
    alignas(64) uint16_t mine[I::W];
    store_out<I, LD>(mine, 0, p);
    const typename I::V user = load_grad<I, LD>(out, i);
    return I::same_bits_select(load_grad<I, LD>(mine, 0), user, p, user);
  } else {
    return p;
  }
}

// Everything one tensor's loop needs, copied out of the task and the scalar struct into locals
// of the loop's own function. The stores through p/m/v/out would otherwise force the compiler
// to reload every pointer, re-broadcast every scalar and re-test every flag once per vector (a
// float store may alias the float and bool fields of AdamTask/AdamScalars); that reload chain
// was what held the AVX2 kernel at ~55% of memory bandwidth (issue 11).
template <class I>
struct Coeffs {
  using V = typename I::V;
  V mult, wd, decay, w1, one_minus_w1, beta2, one_minus_beta2, inv_bc2_sqrt, neg_step_size, eps;
  explicit Coeffs(const AdamScalars& s)
      : mult(I::set1(s.mult)), wd(I::set1(s.wd)), decay(I::set1(s.decay)), w1(I::set1(s.w1)),
        one_minus_w1(I::set1(1.0f - s.w1)), beta2(I::set1(s.beta2)),
        one_minus_beta2(I::set1(s.one_minus_beta2)), inv_bc2_sqrt(I::set1(s.inv_bc2_sqrt)),
        neg_step_size(I::set1(s.neg_step_size)), eps(I::set1(s.eps)) {}
};

// Flags that are not template parameters (rare in practice: Adam's L2 term, a grad multiplier,
// maximize, beta1 <= 0.5), held in locals so the branches cost a register test each.
struct RareFlags {
  bool use_mult, maximize, use_wd, lerp_low;
};

// Update I::W elements starting at i. AMS (amsgrad), DECAY (AdamW's p *= 1 - lr*wd) and RARE
// (any RareFlags member may be set; false means all are off and lerp_low is on) are template
// parameters, so the common AdamW loop has no branch at all.
template <class I, int GD, int OD, bool AMS, bool DECAY, bool RARE>
static inline void adam_block(float* __restrict p_, float* __restrict m_, float* __restrict v_,
                              float* __restrict vmax_, const void* __restrict g_, void* __restrict out_,
                              const Coeffs<I>& c, RareFlags f, int64_t i) {
  using V = typename I::V;
  V g = load_grad<I, GD>(g_, i);
  if (RARE && f.use_mult) g = I::mul(g, c.mult);
  if (RARE && f.maximize) g = I::neg(g);
  V p = adopt_user_writes<I, OD>(out_, i, I::load(p_ + i));
  if (RARE && f.use_wd) g = I::add(g, I::mul(c.wd, p));
  if (DECAY) p = I::mul(p, c.decay);
  V m = I::load(m_ + i);
  if (!RARE || f.lerp_low) {
    m = I::add(m, I::mul(c.w1, I::sub(g, m)));
  } else {
    m = I::sub(g, I::mul(I::sub(g, m), c.one_minus_w1));
  }
  V v = I::load(v_ + i);
  v = I::add(I::mul(v, c.beta2), I::mul(I::mul(c.one_minus_beta2, g), g));
  V vv = v;
  if (AMS) {
    vv = I::max(I::load(vmax_ + i), v);
    I::store(vmax_ + i, vv);
  }
  const V denom = I::add(I::mul(I::sqrt(vv), c.inv_bc2_sqrt), c.eps);
  p = I::add(p, I::div(I::mul(c.neg_step_size, m), denom));
  I::store(m_ + i, m);
  I::store(v_ + i, v);
  I::store(p_ + i, p);
  store_out<I, OD>(out_, i, p);
}

// Software prefetch distance of every streaming loop here and in kernels_moments.h (elements).
// The fp32 loop prefetches each line of its streams once per unrolled iteration. Measured with
// bench/moments_ub (Intel Xeon with AVX-512, 32M elements, 1 thread, TSC cycles per 8 elements,
// one run): fp32 grads 21.5 -> 20.5 (AVX-512 path) and 22.1 -> 20.4 (AVX2 path); bf16 grad + bf16
// out 21.9 -> 20.9 and 23.5 -> 20.6: this CPU's hardware prefetchers alone do not keep five
// streams in flight. On Zen 3 the same prefetch had measured no gain (kernels_moments.h).
constexpr int64_t kQPrefetchAhead = 1024;

// Every line of CHUNK elements of one stream of SIZE-byte elements, kQPrefetchAhead ahead.
template <int64_t CHUNK, int SIZE, bool WRITE>
static inline void prefetch_chunk(const void* base, int64_t i) {
  const char* const a = static_cast<const char*>(base) + (i + kQPrefetchAhead) * SIZE;
  for (int64_t b = 0; b < CHUNK * SIZE; b += 64) __builtin_prefetch(a + b, WRITE ? 1 : 0, 3);
}

// Elements [begin, end) of one tensor. The vector loop is unrolled 4x (kUnroll): with one
// vector per iteration the sqrt/div chain of each vector left too little independent work in
// flight to keep the loads streaming; the rest runs one vector, then one element, at a time.
template <class I, int GD, int OD, bool AMS, bool DECAY, bool RARE>
static void adam_loop(const AdamTask& t, const AdamScalars& s, int64_t begin, int64_t end) {
  constexpr int W = I::W;
#ifdef OFFLOAD_TEST_UNROLL
  constexpr int kUnroll = OFFLOAD_TEST_UNROLL;  // experiments only (bench-results/, not the build)
#else
  constexpr int kUnroll = 4;
#endif
  float* const __restrict p = t.p;
  float* const __restrict m = t.m;
  float* const __restrict v = t.v;
  float* const __restrict vmax = t.vmax;
  const void* const __restrict g = t.g;
  void* const __restrict out = t.out;
  const RareFlags f{s.use_mult, s.maximize, s.use_wd, s.lerp_low};
  const Coeffs<I> c(s);
  int64_t i = begin;
  constexpr int64_t kChunk = kUnroll * W;
  for (; i + kChunk <= end; i += kChunk) {
    if (W > 1 && i + kChunk + kQPrefetchAhead <= end) {  // none past the range this call owns
      prefetch_chunk<kChunk, 4, true>(p, i);
      prefetch_chunk<kChunk, 4, true>(m, i);
      prefetch_chunk<kChunk, 4, true>(v, i);
      if constexpr (AMS) prefetch_chunk<kChunk, 4, true>(vmax, i);
      prefetch_chunk<kChunk, GD == kF32 ? 4 : 2, false>(g, i);
      if constexpr (OD != kNone) prefetch_chunk<kChunk, OD == kF32 ? 4 : 2, true>(out, i);
    }
    for (int u = 0; u < kUnroll; ++u)
      adam_block<I, GD, OD, AMS, DECAY, RARE>(p, m, v, vmax, g, out, c, f, i + u * W);
  }
  for (; i + W <= end; i += W) adam_block<I, GD, OD, AMS, DECAY, RARE>(p, m, v, vmax, g, out, c, f, i);
  if (i < end) {
    const Coeffs<ScalarISA> cs(s);
    for (; i < end; ++i) adam_block<ScalarISA, GD, OD, AMS, DECAY, RARE>(p, m, v, vmax, g, out, cs, f, i);
  }
}

template <class I, int GD, int OD>
static void adam_range_t(const AdamTask& t, const AdamScalars& s, int64_t begin, int64_t end) {
  const bool rare = s.use_mult || s.maximize || s.use_wd || !s.lerp_low;
  const int key = (s.amsgrad ? 4 : 0) | (s.use_decay ? 2 : 0) | (rare ? 1 : 0);
  switch (key) {
    case 0: return adam_loop<I, GD, OD, false, false, false>(t, s, begin, end);
    case 1: return adam_loop<I, GD, OD, false, false, true>(t, s, begin, end);
    case 2: return adam_loop<I, GD, OD, false, true, false>(t, s, begin, end);
    case 3: return adam_loop<I, GD, OD, false, true, true>(t, s, begin, end);
    case 4: return adam_loop<I, GD, OD, true, false, false>(t, s, begin, end);
    case 5: return adam_loop<I, GD, OD, true, false, true>(t, s, begin, end);
    case 6: return adam_loop<I, GD, OD, true, true, false>(t, s, begin, end);
    default: return adam_loop<I, GD, OD, true, true, true>(t, s, begin, end);
  }
}

template <class I, int GD>
static void adam_range_gd(const AdamTask& t, const AdamScalars& s, int64_t b, int64_t e) {
  switch (t.odtype) {
    case kNone: return adam_range_t<I, GD, kNone>(t, s, b, e);
    case kBF16: return adam_range_t<I, GD, kBF16>(t, s, b, e);
    case kF16: return adam_range_t<I, GD, kF16>(t, s, b, e);
    case kBF16Sync: return adam_range_t<I, GD, kBF16Sync>(t, s, b, e);
    case kF16Sync: return adam_range_t<I, GD, kF16Sync>(t, s, b, e);
    default: return adam_range_t<I, GD, kF32>(t, s, b, e);
  }
}

template <class I>
static void adam_range(const AdamTask& t, const AdamScalars& s, int64_t b, int64_t e) {
  switch (t.gdtype) {
    case kBF16: return adam_range_gd<I, kBF16>(t, s, b, e);
    case kF16: return adam_range_gd<I, kF16>(t, s, b, e);
    default: return adam_range_gd<I, kF32>(t, s, b, e);
  }
}

// Sum of squares of g[begin:end) in double, in a fixed order for a given ISA: W double
// lanes... reduced at the end. A non-finite element makes the result inf or nan.
template <class I, int GD>
static double sumsq_t(const void* g, int64_t b, int64_t e) {
  constexpr int W = I::W;
  double acc[W] = {};
  int64_t i = b;
  for (; i + W <= e; i += W) {
    alignas(64) float tmp[W];
    I::store(tmp, load_grad<I, GD>(g, i));
    for (int k = 0; k < W; ++k) acc[k] += static_cast<double>(tmp[k]) * static_cast<double>(tmp[k]);
  }
  double tail = 0.0;
  for (; i < e; ++i) {
    const float x = load_grad<ScalarISA, GD>(g, i);
    tail += static_cast<double>(x) * static_cast<double>(x);
  }
  double total = 0.0;
  for (int k = 0; k < W; ++k) total += acc[k];
  return total + tail;
}

template <class I>
static double sumsq(const void* g, int64_t dtype, int64_t b, int64_t e) {
  switch (dtype) {
    case kBF16: return sumsq_t<I, kBF16>(g, b, e);
    case kF16: return sumsq_t<I, kF16>(g, b, e);
    default: return sumsq_t<I, kF32>(g, b, e);
  }
}

// Memory-bandwidth probe with Adam's access pattern: reads 4 fp32 streams (g, p, m, v) and
// writes 3 (p, m, v), with trivial arithmetic, so its time is the memory system's. It prefetches
// as the kernel does, or the kernel would beat its ceiling.
template <class I>
static void probe_range(float* p, float* m, float* v, const float* g, int64_t b, int64_t e) {
  int64_t i = b;
  const auto c = I::set1(0.5f);
  for (; i + I::W <= e; i += I::W) {
    if (I::W > 1 && (i & 15) < I::W && i + I::W + kQPrefetchAhead <= e) {  // as the fp32 kernel
      prefetch_chunk<16, 4, true>(p, i & ~int64_t{15});
      prefetch_chunk<16, 4, true>(m, i & ~int64_t{15});
      prefetch_chunk<16, 4, true>(v, i & ~int64_t{15});
      prefetch_chunk<16, 4, false>(g, i & ~int64_t{15});
    }
    const auto gg = I::load(g + i);
    I::store(p + i, I::add(I::load(p + i), I::mul(gg, c)));
    I::store(m + i, I::add(I::load(m + i), gg));
    I::store(v + i, I::sub(I::load(v + i), gg));
  }
  for (; i < e; ++i) { p[i] += g[i] * 0.5f; m[i] += g[i]; v[i] -= g[i]; }
}

}  // namespace offload

#include "kernels_moments.h"  // compressed moments (issue 9): uses the helpers above

namespace offload {

// The same probe with the streams of a compressed-moment step (bench: each format's ceiling):
// fp32 p read and written, the gradient read (fp32 or 2-byte), m and v read and written in their
// own element size (MT: float, uint16_t, uint8_t), an optional 2-byte output written. Plain loops
// over the ISA's translation unit, vectorized by its compiler flags; trivial arithmetic.
template <class MT, class GT, bool OUT>
static void probe_fmt_t(float* __restrict p, MT* __restrict m, MT* __restrict v, const GT* __restrict g,
                        uint16_t* __restrict out, int64_t b, int64_t e) {
  // Chunks of 64 elements, one single-type loop per stream inside: one loop mixing 1-, 2- and
  // 4-byte elements vectorized so poorly (widening, index narrowing) that the probe ran slower
  // than the step it is meant to bound. All streams still advance together, as in the kernel.
  // Software prefetch as the kernels do (kQPrefetchAhead): without it this Xeon's hardware
  // prefetchers left the bf16 grad + out probes slower than the kernels.
  constexpr int64_t kChunk = 64;
  auto streams = [&](int64_t from, int64_t to) {
    for (int64_t k = from; k < to; ++k) p[k] += 0.5f * static_cast<float>(g[k]);
    for (int64_t k = from; k < to; ++k) m[k] = static_cast<MT>(m[k] + 1);
    for (int64_t k = from; k < to; ++k) v[k] = static_cast<MT>(v[k] - 1);
    if constexpr (OUT && std::is_same_v<GT, uint16_t>)  // any value: only the write matters
      for (int64_t k = from; k < to; ++k) out[k] = static_cast<uint16_t>(g[k] ^ 1u);
    else if constexpr (OUT)
      for (int64_t k = from; k < to; ++k) out[k] = static_cast<uint16_t>(k);
  };
  int64_t i = b;
  for (; i + kChunk <= e; i += kChunk) {
    if (i + kChunk + kQPrefetchAhead <= e) {
      prefetch_chunk<kChunk, 4, true>(p, i);
      prefetch_chunk<kChunk, sizeof(GT), false>(g, i);
      prefetch_chunk<kChunk, sizeof(MT), true>(m, i);
      prefetch_chunk<kChunk, sizeof(MT), true>(v, i);
      if constexpr (OUT) prefetch_chunk<kChunk, 2, true>(out, i);
    }
    streams(i, i + kChunk);
  }
  streams(i, e);
}

template <class MT>
static void probe_fmt_m(float* p, void* m, void* v, const void* g, void* out, int64_t gbytes, int64_t b, int64_t e) {
  MT* const mm = static_cast<MT*>(m);
  MT* const vv = static_cast<MT*>(v);
  uint16_t* const o = static_cast<uint16_t*>(out);
  if (gbytes == 2) {
    const uint16_t* const g16 = static_cast<const uint16_t*>(g);
    if (o) return probe_fmt_t<MT, uint16_t, true>(p, mm, vv, g16, o, b, e);
    return probe_fmt_t<MT, uint16_t, false>(p, mm, vv, g16, o, b, e);
  }
  const float* const g32 = static_cast<const float*>(g);
  if (o) return probe_fmt_t<MT, float, true>(p, mm, vv, g32, o, b, e);
  return probe_fmt_t<MT, float, false>(p, mm, vv, g32, o, b, e);
}

template <class I>
static void probe_fmt_range(float* p, void* m, void* v, const void* g, void* out, int64_t mbytes, int64_t gbytes,
                            int64_t b, int64_t e) {
  switch (mbytes) {
    case 1: return probe_fmt_m<uint8_t>(p, m, v, g, out, gbytes, b, e);
    case 2: return probe_fmt_m<uint16_t>(p, m, v, g, out, gbytes, b, e);
    default: return probe_fmt_m<float>(p, m, v, g, out, gbytes, b, e);
  }
}

}  // namespace offload

#define OFFLOAD_DEFINE_ISA(NAME, ISA)                                                          \
  namespace offload {                                                                          \
  const IsaKernels kernels_##NAME = {                                                          \
      #NAME, &adam_range<ISA>, &sumsq<ISA>, &probe_range<ISA>, &adam_q_range<ISA>,              \
      &probe_fmt_range<ISA>};                                                                  \
  }
