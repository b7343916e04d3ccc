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
// sqrt(1 - beta2^t) into step size and eps instead measured 1.001x); tests/test_kernel_bitwise.py
// checks it stays within torch's own.
#pragma once
#include "kernels.h"
#include "simd.h"

namespace offload {

// Software prefetch distance of every streaming loop here and in kernels_moments.h (elements).
// The fp32 loop prefetches each line of its streams once per unrolled iteration. Measured with
// bench/moments_ub (Intel Xeon with AVX-512, 32M elements, 1 thread, TSC cycles per 8 elements,
// one run): fp32 grads 21.5 -> 20.5 (AVX-512 path) and 22.1 -> 20.4 (AVX2 path); bf16 grad + bf16
// out 21.9 -> 20.9 and 23.5 -> 20.6: this CPU's hardware prefetchers alone do not keep five
// streams in flight. On Zen 3 the fp32 loop is a little faster without it (the optimizer's step,
// one process, on/off paired over 11-15 rounds at 32M and 128M, flat and many tensors, fp32 and
// bf16, 1 and 2 threads: time with / time without 0.97-1.09, median 1.03, 12 of 16 cells for
// off), so it prefetches only where stream_prefetch() says (kernels.h: on for Intel, off for AMD
// by default); the compressed-moment loops always do (kernels_moments.h).
constexpr int64_t kQPrefetchAhead = 1024;

// Every line of CHUNK elements of one stream of SIZE-byte elements, kQPrefetchAhead ahead.
template <int64_t CHUNK, int SIZE, bool WRITE>
static inline void prefetch_chunk(const void* base, int64_t i) {
  const char* const a = static_cast<const char*>(base) + (i + kQPrefetchAhead) * SIZE;
  for (int64_t b = 0; b < CHUNK * SIZE; b += 64) __builtin_prefetch(a + b, WRITE ? 1 : 0, 3);
}

}  // namespace offload

#include "kernels_dtype.h"  // dtype helpers and passes (use prefetch_chunk)

namespace offload {

// Everything one tensor's loop needs, copied out of the task and the scalar struct into locals
// of the loop's own function. The stores through p/m/v/out would otherwise force the compiler
// to reload every pointer, re-broadcast every scalar and re-test every flag once per vector (a
// float store may alias the float and bool fields of AdamTask/AdamScalars); that reload chain
// was what held the AVX2 kernel at ~55% of memory bandwidth.
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

// Update I::W elements starting at i. GD/OD: the gradient's and the weight copy's dtypes (fused
// pairs, below; the dtype passes of kernels_dtype.h use kF32/kNone). AMS (amsgrad), DECAY
// (AdamW's p *= 1 - lr*wd) and RARE (any RareFlags member may be set; false means all are off and
// lerp_low is on) are template parameters, so the common AdamW loop has no branch at all.
template <class I, int GD, int OD, bool AMS, bool DECAY, bool RARE, bool OUT = true>
static inline typename I::V adam_block(float* __restrict p_, float* __restrict m_, float* __restrict v_,
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
  if constexpr (OUT) store_out<I, OD>(out_, i, p);  // else the caller writes it (adam_loop)
  return p;
}

// kUnroll vectors from i with a bf16 copy (OD kBF16 or kBF16Sync), stored two vectors at a time.
template <class I, int GD, int OD, bool AMS, bool DECAY, bool RARE, int kUnroll>
static inline __attribute__((always_inline)) void adam_bf16_blocks(
    float* __restrict p, float* __restrict m, float* __restrict v, float* __restrict vmax, const void* __restrict g,
    void* __restrict out, const Coeffs<I>& c, RareFlags f, int64_t i) {
  constexpr int W = I::W;
  for (int u = 0; u < kUnroll; u += 2) {
    const auto a = adam_block<I, GD, OD, AMS, DECAY, RARE, false>(p, m, v, vmax, g, out, c, f, i + u * W);
    const auto b = adam_block<I, GD, OD, AMS, DECAY, RARE, false>(p, m, v, vmax, g, out, c, f, i + (u + 1) * W);
    I::store_bf16x2(static_cast<uint16_t*>(out) + i + u * W, a, b);
  }
}

// Elements [0, n) of one tensor's streams (every pointer at the first element). The vector loop
// is unrolled 4x (kUnroll): with one vector per iteration the sqrt/div chain of each vector left
// too little independent work in flight to keep the loads streaming; the rest runs one vector,
// then one element, at a time. Prefetches stay below `room` (the end of the range this call's
// thread owns, counted from the same first element); the gradient is prefetched only if `pf_g`
// (not when it is a chunk widened into L1 by kernels_dtype.h).
template <class I, int GD, int OD, bool AMS, bool DECAY, bool RARE>
static void adam_loop(float* const __restrict p, float* const __restrict m, float* const __restrict v,
                      float* const __restrict vmax, const void* const __restrict g, void* const __restrict out,
                      int64_t n, int64_t room, bool pf_g, const AdamScalars& s) {
  constexpr int W = I::W;
#ifdef OFFLOAD_TEST_UNROLL
  constexpr int kUnroll = OFFLOAD_TEST_UNROLL;  // experiments only (bench-results/, not the build)
#else
  constexpr int kUnroll = 4;
#endif
  const RareFlags f{s.use_mult, s.maximize, s.use_wd, s.lerp_low};
  const Coeffs<I> c(s);
  int64_t i = 0;
  constexpr int64_t kStep = kUnroll * W;
  for (; i + kStep <= n; i += kStep) {
    if (W > 1 && i + kStep + kQPrefetchAhead <= room) {  // none past the range this call owns
      prefetch_chunk<kStep, 4, true>(p, i);
      prefetch_chunk<kStep, 4, true>(m, i);
      prefetch_chunk<kStep, 4, true>(v, i);
      if constexpr (AMS) prefetch_chunk<kStep, 4, true>(vmax, i);
      if (pf_g) prefetch_chunk<kStep, GD == kF32 ? 4 : 2, false>(g, i);
      if constexpr (OD != kNone) prefetch_chunk<kStep, OD == kF32 ? 4 : 2, true>(out, i);
    }
    if constexpr (OD == kBF16 || OD == kBF16Sync) {  // the bf16 copy two vectors at a time
      // the user's parameter: where the quick test passes, no lane has a write to adopt
      if constexpr (OD == kBF16Sync && I::kQuickBF16Sync) {
        if (I::template bf16_quick_in_sync<kStep>(p + i, static_cast<const uint16_t*>(out) + i)) {
          adam_bf16_blocks<I, GD, kBF16, AMS, DECAY, RARE, kUnroll>(p, m, v, vmax, g, out, c, f, i);
          continue;
        }
      }
      adam_bf16_blocks<I, GD, OD, AMS, DECAY, RARE, kUnroll>(p, m, v, vmax, g, out, c, f, i);
    } else {
      for (int u = 0; u < kUnroll; ++u)
        adam_block<I, GD, OD, AMS, DECAY, RARE>(p, m, v, vmax, g, out, c, f, i + u * W);
    }
  }
  for (; i + W <= n; i += W) adam_block<I, GD, OD, AMS, DECAY, RARE>(p, m, v, vmax, g, out, c, f, i);
  if (i < n) {
    const Coeffs<ScalarISA> cs(s);
    for (; i < n; ++i) adam_block<ScalarISA, GD, OD, AMS, DECAY, RARE>(p, m, v, vmax, g, out, cs, f, i);
  }
}

using AdamLoop = void (*)(float*, float*, float*, float*, const void*, void*, int64_t, int64_t, bool,
                          const AdamScalars&);

template <class I, int GD, int OD>
static AdamLoop adam_loop_for(const AdamScalars& s) {
  const bool rare = s.use_mult || s.maximize || s.use_wd || !s.lerp_low;
  switch ((s.amsgrad ? 4 : 0) | (s.use_decay ? 2 : 0) | (rare ? 1 : 0)) {
    case 0: return &adam_loop<I, GD, OD, false, false, false>;
    case 1: return &adam_loop<I, GD, OD, false, false, true>;
    case 2: return &adam_loop<I, GD, OD, false, true, false>;
    case 3: return &adam_loop<I, GD, OD, false, true, true>;
    case 4: return &adam_loop<I, GD, OD, true, false, false>;
    case 5: return &adam_loop<I, GD, OD, true, false, true>;
    case 6: return &adam_loop<I, GD, OD, true, true, false>;
    default: return &adam_loop<I, GD, OD, true, true, true>;
  }
}

// The fused loop of a (gradient, output) dtype pair (fused_pair, kernels_dtype.h), null if the
// pair runs through the dtype passes.
template <class I>
static AdamLoop adam_fused_for(int64_t gdtype, int64_t odtype, const AdamScalars& s) {
  const FusedPair pair = fused_pair<I>(gdtype, odtype);
  if (pair == kPairF32) return adam_loop_for<I, kF32, kNone>(s);
  if constexpr (I::W > 1) {  // (no other pair is fused on the scalar ISA)
    if (pair == kPairF32Out) return adam_loop_for<I, kF32, kF32>(s);
    if (pair == kPairBF16) return adam_loop_for<I, kBF16, kBF16>(s);
    if (pair == kPairBF16Param) return adam_loop_for<I, kBF16, kBF16Sync>(s);
  }
  return nullptr;
}

// Elements [b, e) of one tensor: in one fused pass for the dtype pairs a training step uses
// (fused_pair), else kDChunk elements at a time through the dtype passes of kernels_dtype.h
// around the fp32 loop. Either way each element sees the same operations in the same order.
template <class I>
static void adam_range(const AdamTask& t, const AdamScalars& s, int64_t b, int64_t e) {
  float* const vmax = t.vmax;
  if (const AdamLoop fused = adam_fused_for<I>(t.gdtype, t.odtype, s)) {
    fused(t.p + b, t.m + b, t.v + b, vmax ? vmax + b : nullptr, elem_at(t.g, t.gdtype, b), elem_at(t.out, t.odtype, b),
          e - b, s.prefetch ? e - b : 0, true, s);  // room 0: no software prefetch
    return;
  }
  const AdamLoop loop = adam_loop_for<I, kF32, kNone>(s);
  const float* const stores[] = {t.p + b, t.m + b, t.v + b, vmax ? vmax + b : nullptr};
  through_passes<I>(t.p, t.g, t.gdtype, t.out, t.odtype, b, e, stores, 4, [&](int64_t c, int64_t n, const float* g) {
    loop(t.p + c, t.m + c, t.v + c, vmax ? vmax + c : nullptr, g, nullptr, n, s.prefetch ? e - c : 0, t.gdtype == kF32, s);
  });
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
// writes 3 (p, m, v), with trivial arithmetic, so its time is the memory system's. Modes (the
// bench takes the fastest, so that no kernel's way of walking memory beats its "ceiling"):
//   kProbeFused    every stream per vector, software prefetch as the fp32 kernel
//   kProbeHwOnly   every stream per vector, hardware prefetchers only
//   kProbeStreams  16 KiB tiles, one stream at a time inside a tile (g then read from L1):
//                  two streams in flight instead of seven
// (kProbeTiles, threads on alternate tiles, is the driver's split: adam.cpp.)
template <class I, bool PF>
static void probe_fused(float* p, float* m, float* v, const float* g, int64_t b, int64_t e) {
  int64_t i = b;
  const auto c = I::set1(0.5f);
  for (; i + I::W <= e; i += I::W) {
    if (PF && I::W > 1 && (i & 15) < I::W && i + I::W + kQPrefetchAhead <= e) {  // as the fp32 kernel
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

template <class I>
static void probe_streams(float* p, float* m, float* v, const float* g, int64_t b, int64_t e) {
  constexpr int64_t kTile = 4096;  // 16 KiB of each stream
  const auto c = I::set1(0.5f);
  for (int64_t t = b; t < e; t += kTile) {
    const int64_t te = t + kTile < e ? t + kTile : e;
    int64_t i = t;
    for (; i + I::W <= te; i += I::W) I::store(p + i, I::add(I::load(p + i), I::mul(I::load(g + i), c)));
    for (; i < te; ++i) p[i] += g[i] * 0.5f;
    for (i = t; i + I::W <= te; i += I::W) I::store(m + i, I::add(I::load(m + i), I::load(g + i)));
    for (; i < te; ++i) m[i] += g[i];
    for (i = t; i + I::W <= te; i += I::W) I::store(v + i, I::sub(I::load(v + i), I::load(g + i)));
    for (; i < te; ++i) v[i] -= g[i];
  }
}

template <class I>
static void probe_range(float* p, float* m, float* v, const float* g, int64_t b, int64_t e, int mode) {
  if (mode == kProbeHwOnly) return probe_fused<I, false>(p, m, v, g, b, e);
  if (mode == kProbeStreams) return probe_streams<I>(p, m, v, g, b, e);
  probe_fused<I, true>(p, m, v, g, b, e);
}

}  // namespace offload

#include "kernels_moments.h"  // compressed moments: uses the helpers above

namespace offload {

// The same probe with the streams of a compressed-moment step (bench: each format's ceiling):
// fp32 p read and written, the gradient read (fp32 or 2-byte), m and v read and written in their
// own element size (MT: float, uint16_t, uint8_t), an optional 2-byte output read and written (the
// step reads the user's bf16/fp16 parameter for writes to adopt; a write-only output costs its
// line's read all the same). Plain loops over the ISA's translation unit, vectorized by its
// compiler flags; trivial arithmetic. PF: software prefetch (modes as ProbeMode, common.h).
template <class MT, class GT, bool OUT, bool PF>
static void probe_fmt_t(float* __restrict p, MT* __restrict m, MT* __restrict v, const GT* __restrict g,
                        uint16_t* __restrict out, int64_t b, int64_t e) {
  // Chunks of 64 elements, one single-type loop per stream inside: one loop mixing 1-, 2- and
  // 4-byte elements vectorized so poorly (widening, index narrowing) that the probe ran slower
  // than the step it is meant to bound. All streams still advance together, as in the kernel.
  // Software prefetch as the kernels do (kQPrefetchAhead): without it a Xeon's hardware
  // prefetchers left the bf16 grad + out probes slower than the kernels; on Zen 3 the hardware
  // prefetchers alone are faster (the bench takes the faster way, round by round).
  constexpr int64_t kChunk = 64;
  auto streams = [&](int64_t from, int64_t to) {
    for (int64_t k = from; k < to; ++k) p[k] += 0.5f * static_cast<float>(g[k]);
    for (int64_t k = from; k < to; ++k) m[k] = static_cast<MT>(m[k] + 1);
    for (int64_t k = from; k < to; ++k) v[k] = static_cast<MT>(v[k] - 1);
    if constexpr (OUT)  // any value: only the traffic matters
      for (int64_t k = from; k < to; ++k) out[k] = static_cast<uint16_t>(out[k] + 1u);
  };
  int64_t i = b;
  for (; i + kChunk <= e; i += kChunk) {
    if (PF && i + kChunk + kQPrefetchAhead <= e) {
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

template <class MT, bool PF>
static void probe_fmt_m(float* p, void* m, void* v, const void* g, void* out, int64_t gbytes, int64_t b, int64_t e) {
  MT* const mm = static_cast<MT*>(m);
  MT* const vv = static_cast<MT*>(v);
  uint16_t* const o = static_cast<uint16_t*>(out);
  if (gbytes == 2) {
    const uint16_t* const g16 = static_cast<const uint16_t*>(g);
    if (o) return probe_fmt_t<MT, uint16_t, true, PF>(p, mm, vv, g16, o, b, e);
    return probe_fmt_t<MT, uint16_t, false, PF>(p, mm, vv, g16, o, b, e);
  }
  const float* const g32 = static_cast<const float*>(g);
  if (o) return probe_fmt_t<MT, float, true, PF>(p, mm, vv, g32, o, b, e);
  return probe_fmt_t<MT, float, false, PF>(p, mm, vv, g32, o, b, e);
}

template <bool PF>
static void probe_fmt_pf(float* p, void* m, void* v, const void* g, void* out, int64_t mbytes, int64_t gbytes,
                         int64_t b, int64_t e) {
  switch (mbytes) {
    case 1: return probe_fmt_m<uint8_t, PF>(p, m, v, g, out, gbytes, b, e);
    case 2: return probe_fmt_m<uint16_t, PF>(p, m, v, g, out, gbytes, b, e);
    default: return probe_fmt_m<float, PF>(p, m, v, g, out, gbytes, b, e);
  }
}

template <class I>
static void probe_fmt_range(float* p, void* m, void* v, const void* g, void* out, int64_t mbytes, int64_t gbytes,
                            int64_t b, int64_t e, bool prefetch) {
  if (prefetch) return probe_fmt_pf<true>(p, m, v, g, out, mbytes, gbytes, b, e);
  probe_fmt_pf<false>(p, m, v, g, out, mbytes, gbytes, b, e);
}

}  // namespace offload

#define OFFLOAD_DEFINE_ISA(NAME, ISA)                                                          \
  namespace offload {                                                                          \
  const IsaKernels kernels_##NAME = {                                                          \
      #NAME, &adam_range<ISA>, &sumsq<ISA>, &probe_range<ISA>, &adam_q_range<ISA>,              \
      &probe_fmt_range<ISA>};                                                                  \
  }
