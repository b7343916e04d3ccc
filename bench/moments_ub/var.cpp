// var.cpp: one kernel variant for drv.cpp: compiled once per csrc/ copy (mk.sh -I<dir>
// -DVN=<name>), exporting <name>_q (compressed moments) and <name>_f (fp32 moments), AVX2 only.
#include "kernels_impl.h"
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
namespace offload {
void CAT(VN, _q)(const AdamQTask& t, const AdamScalars& s, int64_t b, int64_t e) { adam_q_range<Avx2ISA>(t, s, b, e); }
void CAT(VN, _f)(const AdamTask& t, const AdamScalars& s, int64_t b, int64_t e) { adam_range<Avx2ISA>(t, s, b, e); }
}
