// tools/arm/insn_count.cpp: one kernel loop of one aarch64 table over n elements, for counting
// its instructions under qemu (tools/arm/insn_plugin.c; tools/arm/check.py --count runs it at two
// lengths and divides the difference by the difference of lengths, so that start-up and the
// filling of the arrays, done for kMax elements whatever n is, cancel out).
// Usage: insn_count TABLE LOOP N, LOOP one of the names in kLoops.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "driver_inputs.h"
#include "kernels.h"
#include "moments.h"

using namespace offload;
using armcheck::table;

namespace {

constexpr int64_t kMax = 1 << 18;

struct Loop {
  const char* name;
  int64_t gd, od, mfmt;  // mfmt 0: fp32 moments; -1: the gradient's sum of squares
};

const Loop kLoops[] = {
    {"fp32", kF32, kNone, 0},
    {"fp32-out", kF32, kF32, 0},
    {"bf16", kBF16, kBF16, 0},
    {"bf16-param", kBF16, kBF16Sync, 0},
    {"f16", kF16, kF16, 0},
    {"mom-bf16", kF32, kNone, kMomBF16},
    {"mom-bf16-bf16", kBF16, kBF16, kMomBF16},
    {"mom-8bit", kF32, kNone, kMom8},
    {"mom-8bit-bf16", kBF16, kBF16, kMom8},
    {"sumsq", kF32, kNone, -1},
    {"sumsq-bf16", kBF16, kNone, -1},
};

}  // namespace

int main(int argc, char** argv) {
  const IsaKernels* k = argc == 4 ? table(argv[1]) : nullptr;
  const Loop* loop = nullptr;
  for (const Loop& l : kLoops)
    if (argc == 4 && std::string(argv[2]) == l.name) loop = &l;
  const int64_t n = argc == 4 ? std::atoll(argv[3]) : -1;
  if (!k || !loop || n < 0 || n > kMax) {
    std::fprintf(stderr, "usage: insn_count TABLE LOOP N (N <= %lld)\n",
                 static_cast<long long>(kMax));
    return 2;
  }
  // every array filled for kMax elements, whatever n is
  std::vector<float> p(kMax), m(kMax), v(kMax), g(kMax), msc(kMax / kQBlock), vsc(kMax / kQBlock);
  std::vector<uint16_t> g16(kMax), out16(kMax), m16(kMax), v16(kMax);
  std::vector<int8_t> mq(kMax);
  std::vector<uint8_t> vq(kMax);
  std::vector<float> out32(kMax);
  for (int64_t i = 0; i < kMax; ++i) {
    p[i] = 1.0f + static_cast<float>(i % 1000) * 1e-3f;
    g[i] = static_cast<float>(i % 77) * 1e-2f - 0.3f;
    m[i] = g[i] * 0.1f;
    v[i] = g[i] * g[i] * 0.01f;
    g16[i] = f32_to_bf16(g[i]);
    out16[i] = f32_to_bf16(p[i]);
    m16[i] = f32_to_bf16(m[i]);
    v16[i] = f32_to_bf16(v[i]);
    mq[i] = static_cast<int8_t>(i % 255 - 127);
    vq[i] = static_cast<uint8_t>(i % 256);
  }
  for (int64_t b = 0; b < kMax / kQBlock; ++b) {
    msc[b] = 1e-10f;
    vsc[b] = 1e-12f;
  }
  if (loop->gd == kF16)
    for (int64_t i = 0; i < kMax; ++i) g16[i] = f32_to_f16(g[i]);
  const void* gp = loop->gd == kF32 ? static_cast<const void*>(g.data()) : g16.data();
  void* op = loop->od == kNone  ? nullptr
             : loop->od == kF32 ? static_cast<void*>(out32.data())
                                : out16.data();
  AdamHyper h{};
  h.lr = 1e-3;
  h.beta1 = 0.9;
  h.beta2 = 0.999;
  h.eps = 1e-8;
  h.weight_decay = 0.01;
  h.decoupled = true;
  h.grad_multiplier = 1.0;
  AdamScalars s = make_scalars(h, 5);
  s.prefetch = true;
  double sink = 0.0;
  if (loop->mfmt == -1) {
    sink = k->sumsq(gp, loop->gd, 0, n);
  } else if (loop->mfmt == 0) {
    const AdamTask t{p.data(), m.data(), v.data(), nullptr, gp, op, n, 5, loop->gd, loop->od};
    k->adam_range(t, s, 0, n);
  } else {
    const bool q8 = loop->mfmt == kMom8;
    const AdamQTask t{p.data(),
                      q8 ? static_cast<void*>(mq.data()) : m16.data(),
                      q8 ? static_cast<void*>(vq.data()) : v16.data(),
                      q8 ? msc.data() : nullptr,
                      q8 ? vsc.data() : nullptr,
                      gp,
                      op,
                      n,
                      5,
                      loop->gd,
                      loop->od,
                      loop->mfmt};
    k->adam_q_range(t, s, 0, q_blocks(n));
  }
  std::printf("%s %s %lld %g\n", k->name, loop->name, static_cast<long long>(n), sink + p[n / 2]);
  return 0;
}
