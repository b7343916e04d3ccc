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
//   p  = p + (-step_size * m) / (sqrt(v or vm) / sqrt(1 - beta2^t) + eps)
//   out = round_to_nearest_even(p)   (optional bf16/fp16 copy for the device)
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
  if constexpr (OD == kBF16) I::store_bf16(static_cast<uint16_t*>(out) + i, x);
  else if constexpr (OD == kF16) I::store_f16(static_cast<uint16_t*>(out) + i, x);
  else if constexpr (OD == kF32) I::store(static_cast<float*>(out) + i, x);
}

// Update I::W elements starting at i.
template <class I, int GD, int OD>
static inline void adam_block(const AdamTask& t, const AdamScalars& s, int64_t i) {
  using V = typename I::V;
  V g = load_grad<I, GD>(t.g, i);
  if (s.use_mult) g = I::mul(g, I::set1(s.mult));
  if (s.maximize) g = I::neg(g);
  V p = I::load(t.p + i);
  if (s.use_wd) g = I::add(g, I::mul(I::set1(s.wd), p));
  if (s.use_decay) p = I::mul(p, I::set1(s.decay));
  V m = I::load(t.m + i);
  if (s.lerp_low) {
    m = I::add(m, I::mul(I::set1(s.w1), I::sub(g, m)));
  } else {
    m = I::sub(g, I::mul(I::sub(g, m), I::set1(1.0f - s.w1)));
  }
  V v = I::load(t.v + i);
  v = I::add(I::mul(v, I::set1(s.beta2)), I::mul(I::mul(I::set1(s.one_minus_beta2), g), g));
  V vv = v;
  if (s.amsgrad) {
    vv = I::max(I::load(t.vmax + i), v);
    I::store(t.vmax + i, vv);
  }
  const V denom = I::add(I::div(I::sqrt(vv), I::set1(s.bc2_sqrt)), I::set1(s.eps));
  p = I::add(p, I::div(I::mul(I::set1(s.neg_step_size), m), denom));
  I::store(t.m + i, m);
  I::store(t.v + i, v);
  I::store(t.p + i, p);
  store_out<I, OD>(t.out, i, p);
}

template <class I, int GD, int OD>
static void adam_range_t(const AdamTask& t, const AdamScalars& s, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + I::W <= end; i += I::W) adam_block<I, GD, OD>(t, s, i);
  for (; i < end; ++i) adam_block<ScalarISA, GD, OD>(t, s, i);
}

template <class I, int GD>
static void adam_range_gd(const AdamTask& t, const AdamScalars& s, int64_t b, int64_t e) {
  switch (t.odtype) {
    case kNone: return adam_range_t<I, GD, kNone>(t, s, b, e);
    case kBF16: return adam_range_t<I, GD, kBF16>(t, s, b, e);
    case kF16: return adam_range_t<I, GD, kF16>(t, s, b, e);
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
// writes 3 (p, m, v), with trivial arithmetic, so its time is the memory system's.
template <class I>
static void probe_range(float* p, float* m, float* v, const float* g, int64_t b, int64_t e) {
  int64_t i = b;
  const auto c = I::set1(0.5f);
  for (; i + I::W <= e; i += I::W) {
    const auto gg = I::load(g + i);
    I::store(p + i, I::add(I::load(p + i), I::mul(gg, c)));
    I::store(m + i, I::add(I::load(m + i), gg));
    I::store(v + i, I::sub(I::load(v + i), gg));
  }
  for (; i < e; ++i) { p[i] += g[i] * 0.5f; m[i] += g[i]; v[i] -= g[i]; }
}

}  // namespace offload

#define OFFLOAD_DEFINE_ISA(NAME, ISA)                                                          \
  namespace offload {                                                                          \
  const IsaKernels kernels_##NAME = {                                                          \
      #NAME, &adam_range<ISA>, &sumsq<ISA>, &probe_range<ISA>};                                \
  }
