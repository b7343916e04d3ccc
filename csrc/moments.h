// moments.h: compressed Adam moments: the formats, the per-tensor task row of the
// separate native entry _C.adam_step_moments, and its driver. The fp32-moment path
// (AdamTask, common.h) is unchanged; this is a second table layout beside it.
//
// Formats (column mfmt):
//   kMomBF16 (2)  m and v stored as bf16 (uint16), decoded exactly, re-encoded round-to-nearest-
//                 even after the update (NaN -> 0x7FC0). m_scale/v_scale unused (0).
//   kMom8    (8)  blockwise 8-bit, blocks of kQBlock = 256 elements of each tensor (the last one
//                 may be shorter), one fp32 scale per block and moment. Byte layout: m int8[n],
//                 v uint8[n], m_scale float[ceil(n/256)], v_scale float[ceil(n/256)].
//                 shr1(x) / shl1(x): the float whose bit pattern is bits(x) >> 1 / bits(x) << 1
//                 (uint32 shifts). For x >= 0, shr1 is a monotone piecewise-linear square root
//                 (shr1(x) = sqrt(x) * 2^-63.5 at even powers of two, within 6% between) and shl1
//                 its exact inverse up to the lowest mantissa bit; shr1(0) = 0.
//                   m: int8 q in [-127, 127], x = q * (m_scale / 127), m = shl1(|x|) with x's sign
//                      (as bits: (bits(x) << 1) | (bits(x) & 0x80000000); |x| < 2 always)
//                   v: uint8 q in [0, 255],   w = q * (v_scale / 255), s = shl1(w), v = s * s
//                 i.e. a square-root-like code of |m| and a 4th-root-like code of v (sqrt(v)'s
//                 square-root-like code), quantized linearly against the block maximum.
//                 Encode: r = shr1(|m|) with m's sign, u = shr1(sqrt(v)) (sqrt(v) is the update's
//                 own, IEEE-exact); m_scale[b] = max |r|, v_scale[b] = max u over block b;
//                 q_m = rne(r * min(127 / m_scale, FLT_MAX)), q_v = rne(u * min(255 / v_scale,
//                 FLT_MAX)) (0 when the scale is 0), clamped to the code range (never needed).
//                 All-zero bytes and scales are the zero state.
//                 Why (measured, 100 steps, gradients = (mean + noise) x a log-normal per-element
//                 scale (sigma 1), so magnitudes spread widely within a block; relative L2 error
//                 vs fp32 moments of m / v / the parameter change):
//                   v linear: 78% of v decoded to 0 (the update becomes m/eps); sqrt(v) linear 11%.
//                   exact roots (sqrt|m|, v^(1/4), the first format): 2.02% / 1.88% / 3.78%, but
//                     two more sqrt per element made the kernel divider-bound on Zen 3 (0.66x the
//                     fp32-moment step at 1 thread, 572 Mparam/s in cache vs fp32's 1825).
//                   this format (shift "roots"): 2.14% / 1.96% / 3.97% (sigma 0.5: param change
//                     1.73% vs 1.66%), no sqrt or division per element.
//                   per-block minifloats (integer encode): v E5M3 29%, E4M4 14% (round to nearest
//                     stalls v's ~0.1-1%/step changes at a 3-4 bit mantissa); m sign+E3M4 3.1%.
//                 A block whose new m or v holds a non-finite value (shr1 of its magnitude >=
//                 kQPoisonBits) is stored "poisoned": bytes 0, both scales the NaN kQPoisonScale
//                 (chosen so that shl1 of it is still a NaN): the whole block decodes to NaN (fp32
//                 moments would poison just the element; the run has diverged either way).
// The update is the fp32 kernel's (kernels_impl.h), decoded -> updated -> encoded in one pass
// (per 256-element block through an L1 scratch for the absmax); results are bitwise equal
// across ISAs, to the scalar reference (adam_reference_moments.cpp) and across thread counts
// (threads split on block boundaries). amsgrad is refused with compressed moments.
#pragma once
#include "common.h"

namespace offload {

enum MomentFormat : int64_t { kMomBF16 = 2, kMom8 = 8 };
constexpr int64_t kQBlock = 256;
constexpr uint32_t kQPoisonBits = 0x7F800000u >> 1;  // shr1(+inf): a code magnitude at or above it is non-finite
constexpr uint32_t kQPoisonScale = 0x7FE00000u;       // scale of a poisoned block (a quiet NaN)

// One row of the int64 table of _C.adam_step_moments (kQTaskCols columns, in this order).
struct AdamQTask {
  float* p;          // fp32 master weights, updated in place
  void* m;           // first moment: uint16[n] (bf16) or int8[n] (8bit)
  void* v;           // second moment: uint16[n] (bf16) or uint8[n] (8bit)
  float* m_scale;    // 8bit: float[ceil(n / 256)], else nullptr
  float* v_scale;    // 8bit: float[ceil(n / 256)], else nullptr
  const void* g;     // gradient, dtype gdtype (kF32 | kBF16 | kF16)
  void* out;         // optional low-precision copy of the new weights (odtype) or nullptr
  int64_t n;         // elements
  int64_t step;      // step count after this update (>= 1)
  int64_t gdtype;
  int64_t odtype;    // kNone | kBF16 | kF16 | kF32 | kBF16Sync | kF16Sync (common.h)
  int64_t mfmt;      // kMomBF16 | kMom8
};
constexpr int kQTaskCols = 12;

static inline int64_t q_blocks(int64_t n) { return (n + kQBlock - 1) / kQBlock; }

// Throws std::invalid_argument on any bad pointer/length/dtype/format/hyperparameter, and for
// amsgrad (no compressed max_exp_avg_sq).
void validate_adam_moments(const AdamQTask* tasks, int64_t ntasks, const AdamHyper& h);
void adam_multi_moments(const AdamQTask* tasks, int64_t ntasks, const AdamHyper& h, int nthreads);
void adam_multi_moments_reference(const AdamQTask* tasks, int64_t ntasks, const AdamHyper& h);
// The plain scalar reference for one tensor (adam_reference_moments.cpp).
void adam_reference_moments(const AdamQTask& t, const AdamHyper& h);

}  // namespace offload
