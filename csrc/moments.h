// moments.h: compressed Adam moments (issue 9): the formats, the per-tensor task row of the
// separate native entry _C.adam_step_moments, and its driver. The fp32-moment path
// (AdamTask, common.h) is unchanged; this is a second table layout beside it.
//
// Formats (column mfmt):
//   kMomBF16 (2)  m and v stored as bf16 (uint16), decoded exactly, re-encoded round-to-nearest-
//                 even after the update (NaN -> 0x7FC0). m_scale/v_scale unused (0).
//   kMom8    (8)  blockwise 8-bit, blocks of kQBlock = 256 elements of each tensor (the last one
//                 may be shorter), one fp32 scale per block and moment. Byte layout: m int8[n],
//                 v uint8[n], m_scale float[ceil(n/256)], v_scale float[ceil(n/256)].
//                   m: int8 q in [-127, 127], x = q * (m_scale / 127), m = x * |x|
//                      (signed square-root code: sqrt(|m|) with m's sign is quantized linearly)
//                   v: uint8 q in [0, 255],   w = q * (v_scale / 255), v = (w*w)*(w*w)
//                      (v's 4th root is quantized linearly)
//                 Encode: r = root(|m|) with m's sign, u = root(sqrt(v)) (sqrt(v) is the update's
//                 own, IEEE-exact), q = rne(r * min(127 / max|r|, FLT_MAX)) and
//                 rne(u * min(255 / max u, FLT_MAX)); m_scale[b] = max |r|, v_scale[b] = max u of
//                 block b. root(x), x >= +0, is a fixed multiply-only square root (two Newton steps
//                 for 1/sqrt(x) from the bit seed y0 = bits(0x5F3759DF - (bits(x) >> 1)); with
//                 h = 0.5f*x: y = y*(1.5f - (h*y)*y) twice; root = x*y), relative error < 6e-6 for
//                 normal x (far below the code's 1/255 steps). It replaces two sqrt instructions:
//                 on Zen 3 the divide/sqrt unit, not memory, limited the kernel with three sqrt
//                 per vector (0.66x the fp32-moment step at 1 thread); it is deterministic IEEE
//                 arithmetic (no rsqrt approximation instruction, which differs by CPU vendor).
//                 Decode is unchanged by it: the value read back depends only on the bytes and scales.
//                 All-zero bytes and scales are the zero state. Decision (measured, 100 steps,
//                 gradients = (mean + noise) x a log-normal per-element scale, so magnitudes
//                 spread widely within a block): v linear decoded 78% of v to 0 (a v decoded to 0
//                 turns the update into m/eps), sqrt(v) coding 11%, 4th root 0%; with v's 4th
//                 root, m linear gave a 16.6% error of the parameter change vs fp32 moments (m
//                 4.5%), m's signed square root 3.8% (m 2.0%, v 1.9%). Per-block minifloat codes
//                 (integer encode, no root) were measured too and lose on v: a 3-4 bit mantissa
//                 cannot follow v's ~1%/step growth (round-to-nearest stalls it), E5M3 gave v 29%,
//                 E4M4 v 14% with 20 v decoded to 0; m as sign+E3M4 gave m 3.1%, param change
//                 3.4% with the 4th-root v (the square-root m was kept: m 2.0%, same decode).
//                 A block whose new m or v holds a non-finite value is stored "poisoned": scales
//                 NaN, bytes 0, so the whole block decodes to NaN (fp32 moments would poison just
//                 the element; the run has diverged either way).
// The update is the fp32 kernel's (kernels_impl.h), decoded -> updated -> encoded in one pass
// (per 256-element block through an L1 scratch for the absmax); results are bitwise equal
// across ISAs, to the scalar reference (adam_reference_moments.cpp) and across thread counts
// (threads split on block boundaries). amsgrad is refused with compressed moments.
#pragma once
#include "common.h"

namespace offload {

enum MomentFormat : int64_t { kMomBF16 = 2, kMom8 = 8 };
constexpr int64_t kQBlock = 256;
constexpr uint32_t kRootMagic = 0x5F3759DFu;  // seed of root() (see kMom8 above)

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
  int64_t odtype;    // kNone | kBF16 | kF16 | kF32
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
