// kernels_sve.h: the kernel table of an SVE build for one vector length (kernels_sve<bits>.cpp,
// each compiled with -march=armv8-a+sve -msve-vector-bits=<bits>). Such code is right only where
// the vector length is exactly <bits>: cpu_features.cpp chooses it only then, and every entry
// here reads the calling thread's length first (RDVL: one instruction per call) and hands the
// call to the NEON kernels where it differs (a thread that changed its length with
// prctl(PR_SVE_SET_VL)), which compute the same bits (sumsq: up to its lane count's rounding).
#pragma once
#include "kernels_impl.h"

namespace offload {
namespace {

inline bool sve_length_matches() {
  uint64_t bytes;
  __asm__("rdvl %0, #1" : "=r"(bytes));
  return bytes * 8 == SveISA::kBits;
}

void sve_adam_range(const AdamTask& t, const AdamScalars& s, int64_t b, int64_t e) {
  if (sve_length_matches()) return adam_range<SveISA>(t, s, b, e);
  kernels_neon.adam_range(t, s, b, e);
}

double sve_sumsq(const void* g, int64_t dtype, int64_t b, int64_t e) {
  return sve_length_matches() ? sumsq<SveISA>(g, dtype, b, e) : kernels_neon.sumsq(g, dtype, b, e);
}

void sve_probe(float* p, float* m, float* v, const float* g, int64_t b, int64_t e, int mode) {
  if (sve_length_matches()) return probe_range<SveISA>(p, m, v, g, b, e, mode);
  kernels_neon.probe(p, m, v, g, b, e, mode);
}

void sve_adam_q_range(const AdamQTask& t, const AdamScalars& s, int64_t bb, int64_t be) {
  if (sve_length_matches()) return adam_q_range<SveISA>(t, s, bb, be);
  kernels_neon.adam_q_range(t, s, bb, be);
}

void sve_probe_fmt(float* p, void* m, void* v, const void* g, void* out, int64_t mbytes,
                   int64_t gbytes, int64_t b, int64_t e, bool prefetch) {
  if (sve_length_matches())
    return probe_fmt_range<SveISA>(p, m, v, g, out, mbytes, gbytes, b, e, prefetch);
  kernels_neon.probe_fmt(p, m, v, g, out, mbytes, gbytes, b, e, prefetch);
}

}  // namespace
}  // namespace offload

#define OFFLOAD_DEFINE_SVE(BITS)                                                               \
  static_assert(offload::SveISA::kBits == BITS, "compile with -msve-vector-bits=" #BITS);     \
  namespace offload {                                                                          \
  const IsaKernels kernels_sve##BITS = {"sve" #BITS, &sve_adam_range, &sve_sumsq, &sve_probe,  \
                                        &sve_adam_q_range, &sve_probe_fmt};                    \
  }
