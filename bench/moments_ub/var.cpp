// var.cpp: one kernel variant for drv.cpp: compiled once per csrc/ copy (mk.sh -I<dir>
// -DVN=<name>), exporting <name>_q (compressed moments) and <name>_f (fp32 moments); AVX2 unless
// the variant's flags say -DVISA=Avx512ISA (with the AVX-512 -m flags: see mk.sh).
#include "kernels_impl.h"
#ifndef VISA
#define VISA Avx2ISA
#endif
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
namespace offload {
void CAT(VN, _q)(const AdamQTask& t, const AdamScalars& s, int64_t b, int64_t e) { adam_q_range<VISA>(t, s, b, e); }
void CAT(VN, _f)(const AdamTask& t, const AdamScalars& s, int64_t b, int64_t e) { adam_range<VISA>(t, s, b, e); }
}
