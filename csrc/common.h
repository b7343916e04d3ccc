// common.h: shared types for the native core: dtype codes, status codes, the per-tensor task
// descriptor passed from Python, and exact scalar conversions between fp32 and bf16/fp16.
// No torch headers: everything crosses the boundary as raw pointers plus lengths.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>

namespace offload {

// Element types accepted for gradients and produced for low-precision weight copies.
// kBF16Sync / kF16Sync (output codes only): `out` is the user's own bf16/fp16 parameter, not a
// copy for a device. Before the update, every element of it that differs (bit pattern) from
// round(master) was written by the user since the last step (`p.data.mul_()` and the like are
// invisible to version counters), so the master takes the user's value there, as torch's
// AdamW would step from it; then out = round(new master) as for kBF16 / kF16.
enum DType : int64_t { kNone = 0, kF32 = 1, kBF16 = 2, kF16 = 3, kBF16Sync = 4, kF16Sync = 5 };

static inline const char* dtype_name(int64_t d) {
  switch (d) {
    case kNone: return "none";
    case kF32: return "float32";
    case kBF16: return "bfloat16";
    case kF16: return "float16";
    case kBF16Sync: return "bfloat16 (user's parameter)";
    case kF16Sync: return "float16 (user's parameter)";
    default: return "invalid";
  }
}

// How the bandwidth probe walks memory (kernels_impl.h probe_range; kProbeTiles is kProbeFused with
// threads on alternate 1 MiB tiles instead of one contiguous share each, adam.cpp).
enum ProbeMode : int { kProbeFused = 0, kProbeHwOnly = 1, kProbeTiles = 2, kProbeStreams = 3 };
constexpr int kProbeModes = 4;

// One tensor of a multi-tensor Adam call. Layout matches the int64 table built in
// offload/native/adam.py (one row per tensor, kTaskCols columns).
struct AdamTask {
  float* p;          // fp32 master weights, updated in place
  float* m;          // first moment
  float* v;          // second moment
  float* vmax;       // running max of v (amsgrad) or nullptr
  const void* g;     // gradient, dtype gdtype
  void* out;         // optional low-precision copy of the new weights (dtype odtype) or nullptr
  int64_t n;         // elements
  int64_t step;      // step count after this update (>= 1), for bias correction
  int64_t gdtype;    // kF32 | kBF16 | kF16
  int64_t odtype;    // kNone | kBF16 | kF16 | kF32 | kBF16Sync | kF16Sync
};
constexpr int kTaskCols = 10;
// Compressed (bf16 / 8-bit) moments use a second table layout and entry: AdamQTask in moments.h.

// Hyperparameters of one call, as the user gave them (double precision).
struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay, grad_multiplier;
  bool decoupled, amsgrad, maximize;
};

// Scalars of one tensor's update, computed once in double and rounded to fp32 once.
struct AdamScalars {
  float mult;          // grad multiplier
  float wd;            // L2 coefficient (Adam) -- 0 when decoupled
  float decay;         // 1 - lr*wd (AdamW) -- 1 when coupled
  float w1;            // 1 - beta1 (lerp weight)
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;      // sqrt(1 - beta2^step)
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^step), rounded once from double (the kernels multiply by it)
  float neg_step_size; // -lr / (1 - beta1^step)
  float eps;
  bool use_mult, use_wd, use_decay, lerp_low, amsgrad, maximize;
  bool prefetch;        // the fp32 loop's software prefetch (kernels.h stream_prefetch)
};

static inline AdamScalars make_scalars(const AdamHyper& h, int64_t step) {
  AdamScalars s{};
  const double st = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(h.beta1, st);
  const double bc2 = 1.0 - std::pow(h.beta2, st);
  s.mult = static_cast<float>(h.grad_multiplier);
  s.use_mult = h.grad_multiplier != 1.0;
  s.use_wd = !h.decoupled && h.weight_decay != 0.0;
  s.wd = static_cast<float>(h.weight_decay);
  s.use_decay = h.decoupled && h.weight_decay != 0.0;
  s.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.w1 = static_cast<float>(1.0 - h.beta1);
  // torch's lerp switches formula at weight 0.5; mirror it.
  s.lerp_low = std::fabs(1.0 - h.beta1) < 0.5;
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  s.neg_step_size = static_cast<float>(-(h.lr / bc1));
  s.eps = static_cast<float>(h.eps);
  s.amsgrad = h.amsgrad;
  s.maximize = h.maximize;
  return s;
}

// ---- exact scalar conversions (same bits as torch's c10::BFloat16 / c10::Half) ----
static inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN becomes the canonical quiet NaN 0x7FC0 (as c10::BFloat16 does).
static inline uint16_t f32_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const uint32_t u = f32_bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  uint32_t out;
  if (exp == 0x1F) {
    out = sign | 0x7F800000u | (man << 13);                    // inf / nan
  } else if (exp != 0) {
    out = sign | ((exp + 112u) << 23) | (man << 13);           // normal
  } else if (man == 0) {
    out = sign;                                                // zero
  } else {                                                     // subnormal: normalise
    int e = -1;
    do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
    out = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3FFu) << 13);
  }
  return bits_f32(out);
}

// Round to nearest even with correct subnormals and overflow to inf (same as F16C's
// vcvtps2ph with round-to-nearest). NaN keeps its sign and becomes quiet (0x7E00).
static inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;                 // nan
  if (a >= 0x477FF000u) return sign | 0x7C00u;                 // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                       // result subnormal or zero
    if (a < 0x33000000u) return sign;                          // < 2^-25: rounds to 0
    const uint32_t e = a >> 23;
    const uint32_t man = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - e;                           // 14..24 bits dropped (125-e+1)
    const uint32_t half = 1u << (shift - 1);
    uint32_t r = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  // normal: rebias exponent (127 -> 15) and round the 13 dropped mantissa bits
  uint32_t r = a - 0x38000000u;
  r += 0xFFFu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

// Scalar reference helpers shared by adam_reference.cpp and adam_reference_moments.cpp.
// Gradient element i widened exactly to fp32 (dtype kF32 | kBF16 | kF16).
static inline float load_grad_scalar(const void* g, int64_t dtype, int64_t i) {
  if (dtype == kBF16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  if (dtype == kF16) return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
  return static_cast<const float*>(g)[i];
}

// The master's value before an update when out may be the user's parameter (kBF16Sync/kF16Sync):
// an element of out that is not round(master) was written by the user and is taken instead.
static inline float adopt_user_write(float master, const void* out, int64_t odtype, int64_t i) {
  if (odtype == kBF16Sync) {
    const uint16_t u = static_cast<const uint16_t*>(out)[i];
    return f32_to_bf16(master) != u ? bf16_to_f32(u) : master;
  }
  if (odtype == kF16Sync) {
    const uint16_t u = static_cast<const uint16_t*>(out)[i];
    return f32_to_f16(master) != u ? f16_to_f32(u) : master;
  }
  return master;
}

// out[i] = p rounded to out's type (nothing for kNone).
static inline void store_out_scalar(void* out, int64_t odtype, int64_t i, float p) {
  if (odtype == kBF16 || odtype == kBF16Sync) static_cast<uint16_t*>(out)[i] = f32_to_bf16(p);
  else if (odtype == kF16 || odtype == kF16Sync) static_cast<uint16_t*>(out)[i] = f32_to_f16(p);
  else if (odtype == kF32) static_cast<float*>(out)[i] = p;
}

}  // namespace offload
