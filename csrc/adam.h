// adam.h: multi-tensor entry points: validate a task table, partition it across the thread
// pool, and run the active ISA's kernels (or the scalar reference).
#pragma once
#include "common.h"

namespace offload {

// Throws std::invalid_argument on any bad pointer/length/dtype/hyperparameter.
void validate_adam(const AdamTask* tasks, int64_t ntasks, const AdamHyper& h);

// Update every tensor of the table, using up to nthreads threads. Results are bitwise
// identical for any nthreads (elementwise math; see kernels_impl.h).
void adam_multi(const AdamTask* tasks, int64_t ntasks, const AdamHyper& h, int nthreads);

// Same update through the plain scalar reference, single-threaded.
void adam_multi_reference(const AdamTask* tasks, int64_t ntasks, const AdamHyper& h);

struct GradTask {
  const void* g;
  int64_t n;
  int64_t dtype;
};
constexpr int kGradCols = 3;

// Sum of squares over all gradients, in double; deterministic for any thread count (fixed
// blocks summed in a fixed order). Non-finite input yields inf or nan.
double grad_sumsq(const GradTask* tasks, int64_t ntasks, int nthreads);

// Bandwidth probe: reads g, p, m, v and writes p, m, v (n floats each), walking memory in one of
// the ProbeMode ways (common.h).
void bandwidth_probe(float* p, float* m, float* v, const float* g, int64_t n, int nthreads, int mode);
// Position-weighted sum of the 32-bit words of [p, p + nbytes) (each word as int32 times an odd
// pseudo-random int32 weight, exact 64-bit products, summed mod 2^64); a trailing 1-3 bytes count
// as one more word. Any single changed word changes it. (offload/params/fingerprint.py: CPU tensors.)
int64_t fingerprint_bytes(const void* p, int64_t nbytes);
// The probe with a compressed-moment step's streams (kernels.h IsaKernels::probe_fmt), in mode
// kProbeFused, kProbeHwOnly or kProbeTiles (common.h).
void bandwidth_probe_fmt(float* p, void* m, void* v, const void* g, void* out, int64_t n, int64_t mbytes,
                         int64_t gbytes, int nthreads, int mode);

}  // namespace offload
