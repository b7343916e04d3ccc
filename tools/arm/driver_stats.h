// tools/arm/driver_stats.h: the aarch64 bitwise driver's (driver.cpp) cases besides the updates:
// the gradient's sum of squares and the bandwidth probes of a kernel table.
#pragma once
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "driver_inputs.h"
#include "kernels.h"

namespace armcheck {

using namespace offload;

// The sum of squares of [b, n) against its order written out for the table's lane count L: lane k
// sums elements b + k, b + k + L, ... of the whole vectors in double, the tail in order after.
inline void sumsq_case(Report& rep, const IsaKernels& k, int L, int64_t dtype, int64_t n,
                       int64_t b, int extra) {
  Rng r(90001u * static_cast<uint64_t>(extra) + static_cast<uint64_t>(n));
  const int64_t gs = dsize(dtype);
  Buf<unsigned char> g(n * gs, static_cast<int>((extra % 5) * gs));
  const bool specials =
      extra % 4 == 3;  // else finite: the sum's value, not just its NaN, is compared
  for (int64_t i = 0; i < n; ++i) {
    if (dtype == kF32) {
      const float x = value(r, 3.0, specials);
      std::memcpy(g.p + 4 * i, &x, 4);
    } else {
      uint16_t w;
      do w = half_word(r, dtype == kBF16);
      while (!specials && !std::isfinite(widen16(w, dtype == kBF16)));
      std::memcpy(g.p + 2 * i, &w, 2);
    }
  }
  std::vector<double> acc(L, 0.0);
  int64_t i = b;
  for (; i + L <= n; i += L)
    for (int j = 0; j < L; ++j) {
      const double x = load_grad_scalar(g.p, dtype, i + j);
      acc[j] += x * x;
    }
  double tail = 0.0, want = 0.0;
  for (; i < n; ++i) {
    const double x = load_grad_scalar(g.p, dtype, i);
    tail += x * x;
  }
  for (int j = 0; j < L; ++j) want += acc[j];
  want += tail;
  const double got = k.sumsq(g.p, dtype, b, n);
  ++rep.cases;
  const bool same = std::isnan(want) ? std::isnan(got) : std::memcmp(&want, &got, 8) == 0;
  if (!same) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s sumsq %s n=%lld from=%lld: %a, expected %a (%d lanes)",
                  k.name, dtype_name(dtype), static_cast<long long>(n), static_cast<long long>(b),
                  got, want, L);
    rep.fail(buf);
  }
}

// The bandwidth probes (arithmetic only there so that their traffic is real) against the scalar
// table.
inline void probe_case(Report& rep, const IsaKernels& k, int64_t n, int64_t b, int extra) {
  Rng r(50021u * static_cast<uint64_t>(extra) + static_cast<uint64_t>(n));
  const int off = extra % 5;
  Buf<float> p(n, off), m(n, off), v(n, off), g(n, off);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = value(r, 1, false);
    m[i] = value(r, 1, false);
    v[i] = value(r, 1, false);
    g[i] = value(r, 1, false);
  }
  Buf<float> rp = p.clone(0), rm = m.clone(0), rv = v.clone(0);
  const int mode =
      (extra % 3 == 2) ? kProbeStreams : extra % 2;  // fused, hardware-prefetch only, streams
  k.probe(p.p, m.p, v.p, g.p, b, n, mode);
  kernels_scalar.probe(rp.p, rm.p, rv.p, g.p, b, n, mode);
  const std::string w =
      std::string(k.name) + " probe mode " + std::to_string(mode) + " n=" + std::to_string(n);
  ++rep.cases;
  same_bytes(rep, w + " p", p.p, rp.p, n, 4) && same_bytes(rep, w + " m", m.p, rm.p, n, 4) &&
      same_bytes(rep, w + " v", v.p, rv.p, n, 4);
  const int64_t mb = 1 << (extra % 3), gb = extra % 2 ? 2 : 4;
  const bool with_out = extra % 4 < 2;
  Buf<unsigned char> qm(n * mb, off), qv(n * mb, off), qg(n * gb, off), qo(n * 2, off);
  for (int64_t i = 0; i < n * mb; ++i) {
    qm[i] = static_cast<unsigned char>(r.bits());
    qv[i] = static_cast<unsigned char>(r.bits());
  }
  for (int64_t i = 0; i < n; ++i) {
    if (gb == 4) {
      const float x = value(r, 3, false);
      std::memcpy(qg.p + 4 * i, &x, 4);
    } else {
      const uint16_t x = static_cast<uint16_t>(r.bits());
      std::memcpy(qg.p + 2 * i, &x, 2);
    }
  }
  for (int64_t i = 0; i < 2 * n; ++i) qo[i] = static_cast<unsigned char>(r.bits());
  Buf<float> sp = rp.clone(0);
  Buf<unsigned char> sm = qm.clone(0), sv = qv.clone(0), so = qo.clone(0);
  Buf<float> kp = rp.clone(off);
  k.probe_fmt(kp.p, qm.p, qv.p, qg.p, with_out ? qo.p : nullptr, mb, gb, b, n, extra % 2);
  kernels_scalar.probe_fmt(sp.p, sm.p, sv.p, qg.p, with_out ? so.p : nullptr, mb, gb, b, n,
                           extra % 2);
  const std::string f =
      std::string(k.name) + " probe_fmt m" + std::to_string(mb) + " g" + std::to_string(gb);
  ++rep.cases;
  same_bytes(rep, f + " p", kp.p, sp.p, n, 4) &&
      same_bytes(rep, f + " m", qm.p, sm.p, n * mb, 1) &&
      same_bytes(rep, f + " v", qv.p, sv.p, n * mb, 1) &&
      same_bytes(rep, f + " out", qo.p, so.p, 2 * n, 1);
}

}  // namespace armcheck
