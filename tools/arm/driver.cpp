// tools/arm/driver.cpp: the aarch64 bitwise driver (built and run under qemu by
// tools/arm/check.py). Every loop of a kernel table (fp32 Adam with every gradient/output dtype
// pair and Adam variant, the compressed bf16 and 8-bit moments, the gradient sum of squares, the
// bandwidth probes) is compared byte for byte with the scalar reference (adam_reference*.cpp; for
// the sum of squares its order written out for the table's lane count; the probes against the
// scalar table) on random inputs with edge values, lengths that are not multiples of any vector
// width and misaligned starts. Usage: driver --expect ISA --full T1,T2 [--share T3,...]: ISA is
// the table the dispatch must choose; --full tables get every case; --share tables a quarter of
// the update cases (SVE builds for another vector length, which hand each call to NEON; the
// scalar build, which the dispatch never chooses on aarch64). Exit 1 on any difference.
#include <sys/prctl.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam.h"
#include "driver_inputs.h"
#include "driver_stats.h"
#include "kernels.h"
#include "moments.h"
#include "threadpool.h"

using namespace offload;
using namespace armcheck;

namespace {

Report rep;
const int64_t kSizes[] = {1,   3,    4,    5,    7,    15,   16,   17,   31,
                          33,  63,   64,   65,   127,  129,  255,  256,  257,
                          511, 1023, 1025, 1100, 1347, 2049, 3001, 4133, 5121};
constexpr int kNSizes = sizeof(kSizes) / sizeof(kSizes[0]);
const int64_t kGD[] = {kF32, kBF16, kF16};
const int64_t kOD[] = {kNone, kF32, kBF16, kF16, kBF16Sync, kF16Sync};

int sve_bits_now() {
  const int vl = prctl(PR_SVE_GET_VL, 0, 0, 0, 0);
  return vl < 0 ? 0 : (vl & 0xffff) * 8;
}

// The lanes of a table's sum of squares: an SVE table at another vector length runs NEON's.
int lanes(const IsaKernels& k) {
  const std::string n = k.name;
  if (n == "scalar") return 1;
  if (n == "neon") return 4;
  const int bits = std::stoi(n.substr(3));
  return bits == sve_bits_now() ? bits / 32 : 4;
}

// Adam and AdamW x amsgrad x maximize x weight decay (variant bits), plus by `extra`: a gradient
// multiplier, beta1 < 0.5 (torch's other lerp form), lr 0 (the output is round(p) exactly).
AdamHyper hyper(int variant, int extra) {
  AdamHyper h{};
  h.lr = extra % 7 == 6 ? 0.0 : 1e-2;
  h.beta1 = extra % 5 == 4 ? 0.3 : 0.9;
  h.beta2 = 0.999;
  h.eps = 1e-8;
  h.decoupled = variant & 1;
  h.amsgrad = variant & 2;
  h.maximize = variant & 4;
  h.weight_decay = variant & 8 ? 0.1 : 0.0;
  h.grad_multiplier = extra % 2 ? 0.5 : 1.0;
  return h;
}

// The streams every update reads and writes: fp32 master, gradient and output in their dtypes.
// A NaN is never in two operands of one element's operation (which NaN an IEEE operation returns
// then depends on the compiler's operand order), as in tests/kernel_util.py nonfinite_inputs.
struct Common {
  Buf<float> p;
  Buf<unsigned char> g, out;
  // No NaN in [b, e) (a block whose moments decode to NaN: every operation has a NaN operand
  // there).
  void no_nans(int64_t b, int64_t e, int64_t gd, int64_t od) {
    for (int64_t i = b; i < e; ++i) {
      if (std::isnan(p[i])) p[i] = 1.5f;
      if (std::isnan(load_grad_scalar(g.p, gd, i))) std::memset(g.p + i * dsize(gd), 0, dsize(gd));
      if (od == kBF16Sync) {
        const uint16_t w = f32_to_bf16(p[i]);
        std::memcpy(out.p + 2 * i, &w, 2);
      }
      if (od == kF16Sync) {
        const uint16_t w = f32_to_f16(p[i]);
        std::memcpy(out.p + 2 * i, &w, 2);
      }
    }
  }
  Common(Rng& r, int64_t n, int off, int64_t gd, int64_t od)
      : p(n, off),
        g(n * dsize(gd), static_cast<int>(off * dsize(gd))),
        out(n * dsize(od), static_cast<int>(off * dsize(od))) {
    for (int64_t i = 0; i < n; ++i) {
      p[i] = value(r, 1.0, true);
      const bool pnan = std::isnan(p[i]);
      uint32_t gnan_free = 0;
      if (gd == kF32) {
        const float x = value(r, 3.0, !pnan);
        std::memcpy(g.p + 4 * i, &x, 4);
      } else {
        uint16_t w;
        do w = half_word(r, gd == kBF16);
        while (pnan && std::isnan(widen16(w, gd == kBF16)));
        std::memcpy(g.p + 2 * i, &w, 2);
      }
      gnan_free = !std::isnan(load_grad_scalar(g.p, gd, i));
      if (od == kBF16Sync ||
          od == kF16Sync) {  // the user's parameter: round(p), or a user's write
        const bool bf = od == kBF16Sync;
        uint16_t w = bf ? f32_to_bf16(p[i]) : f32_to_f16(p[i]);
        if (r.below(8) == 0) do
            w = half_word(r, bf);
          while (!gnan_free && std::isnan(widen16(w, bf)));
        std::memcpy(out.p + 2 * i, &w, 2);
      } else {
        for (int64_t k = 0; k < dsize(od); ++k) out.p[i * dsize(od) + k] = 0xAB;
      }
    }
  }
};

// One fp32-moment update of elements [b, n) by table k against adam_reference.
void adam_case(const IsaKernels& k, int64_t gd, int64_t od, int variant, int extra, int64_t n,
               int64_t b, int off) {
  Rng r(1000003u * static_cast<uint64_t>(extra) + static_cast<uint64_t>(n));
  Common c(r, n, off, gd, od);
  Buf<float> m(n, off), v(n, off), vmax(n, off);
  for (int64_t i = 0; i < n; ++i) {
    m[i] = static_cast<float>(r.normal() * 0.1);
    v[i] = static_cast<float>(r.uniform() * 0.01);
    vmax[i] = v[i] + static_cast<float>(r.uniform() * 0.01);
  }
  Buf<float> rp = c.p.clone(0), rm = m.clone(0), rv = v.clone(0), rvmax = vmax.clone(0);
  Buf<unsigned char> rg = c.g.clone(0), rout = c.out.clone(0);
  const AdamHyper h = hyper(variant, extra);
  const int64_t step = 1 + extra % 4, gs = dsize(gd), os = dsize(od);
  AdamTask t{c.p.p, m.p, v.p, h.amsgrad ? vmax.p : nullptr, c.g.p, od ? c.out.p : nullptr, n,
             step,  gd,  od};
  AdamScalars s = make_scalars(h, step);
  s.prefetch = extra % 3 == 0;
  k.adam_range(t, s, b, n);
  AdamTask rt{rp.p + b,
              rm.p + b,
              rv.p + b,
              h.amsgrad ? rvmax.p + b : nullptr,
              rg.p + b * gs,
              od ? rout.p + b * os : nullptr,
              n - b,
              step,
              gd,
              od};
  adam_reference(rt, h);
  char what[160];
  std::snprintf(what, sizeof what,
                "%s adam g=%s out=%s variant=%d extra=%d n=%lld from=%lld off=%d", k.name,
                dtype_name(gd), dtype_name(od), variant, extra, static_cast<long long>(n),
                static_cast<long long>(b), off);
  const std::string w = what;
  ++rep.cases;
  same_bytes(rep, w + " p", c.p.p, rp.p, n, 4) && same_bytes(rep, w + " m", m.p, rm.p, n, 4) &&
      same_bytes(rep, w + " v", v.p, rv.p, n, 4) &&
      same_bytes(rep, w + " vmax", vmax.p, rvmax.p, n, 4) &&
      same_bytes(rep, w + " out", c.out.p, rout.p, n * os, 1);
}

// One compressed-moment update of blocks [bb, end) by table k against adam_reference_moments.
// 8-bit moments start from two reference steps (realistic codes and scales); a poisoned block
// and an all-zero block where the tensor has them.
void q_case(const IsaKernels& k, int64_t fmt, int64_t gd, int64_t od, int variant, int extra,
            int64_t n, int64_t bb, int off) {
  Rng r(7000003u * static_cast<uint64_t>(extra) + static_cast<uint64_t>(n) +
        static_cast<uint64_t>(fmt));
  Common c(r, n, off, gd, od);
  const bool q8 = fmt == kMom8;
  const int64_t ms = q8 ? 1 : 2, nb = q_blocks(n);
  Buf<unsigned char> m(n * ms, static_cast<int>(off * ms)), v(n * ms, static_cast<int>(off * ms));
  Buf<float> msc(nb, off), vsc(nb, off);
  for (int64_t i = 0; i < nb; ++i) msc[i] = vsc[i] = 0.0f;
  if (q8) {
    std::memset(m.p, 0, n);
    std::memset(v.p, 0, n);
    Buf<float> p0 = c.p.clone(0), g0(n, 0);
    for (int step = 1; step <= 2; ++step) {
      for (int64_t i = 0; i < n; ++i) {
        p0[i] = static_cast<float>(r.normal());
        g0[i] = static_cast<float>(r.normal());
      }
      const AdamQTask t0{p0.p, m.p, v.p, msc.p, vsc.p, g0.p, nullptr, n, step, kF32, kNone, kMom8};
      adam_reference_moments(t0, hyper(0, 0));
    }
    if (nb >= 3 && extra % 3 == 0) {
      msc[1] = vsc[1] = bits_f32(kQPoisonScale);
      c.no_nans(kQBlock, 2 * kQBlock, gd, od);
    }
    if (nb >= 4) {
      std::memset(m.p + 512, 0, 256);
      std::memset(v.p + 512, 0, 256);
      msc[2] = vsc[2] = 0.0f;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t a = f32_to_bf16(static_cast<float>(r.normal() * 0.1));
      const uint16_t b = f32_to_bf16(static_cast<float>(r.uniform() * 0.01));
      std::memcpy(m.p + 2 * i, &a, 2);
      std::memcpy(v.p + 2 * i, &b, 2);
    }
  }
  Buf<float> rp = c.p.clone(0), rmsc = msc.clone(0), rvsc = vsc.clone(0);
  Buf<unsigned char> rg = c.g.clone(0), rout = c.out.clone(0), rm = m.clone(0), rv = v.clone(0);
  const AdamHyper h = hyper(variant & ~2, extra);  // (no amsgrad with compressed moments)
  const int64_t step = 1 + extra % 4, gs = dsize(gd), os = dsize(od), b = bb * kQBlock;
  AdamQTask t{c.p.p,
              m.p,
              v.p,
              q8 ? msc.p : nullptr,
              q8 ? vsc.p : nullptr,
              c.g.p,
              od ? c.out.p : nullptr,
              n,
              step,
              gd,
              od,
              fmt};
  k.adam_q_range(t, make_scalars(h, step), bb, nb);
  AdamQTask rt{rp.p + b,
               rm.p + b * ms,
               rv.p + b * ms,
               q8 ? rmsc.p + bb : nullptr,
               q8 ? rvsc.p + bb : nullptr,
               rg.p + b * gs,
               od ? rout.p + b * os : nullptr,
               n - b,
               step,
               gd,
               od,
               fmt};
  adam_reference_moments(rt, h);
  char what[160];
  std::snprintf(what, sizeof what,
                "%s moments=%s g=%s out=%s variant=%d extra=%d n=%lld from block %lld off=%d",
                k.name, q8 ? "8bit" : "bf16", dtype_name(gd), dtype_name(od), variant & ~2, extra,
                static_cast<long long>(n), static_cast<long long>(bb), off);
  const std::string w = what;
  ++rep.cases;
  same_bytes(rep, w + " p", c.p.p, rp.p, n, 4) &&
      same_bytes(rep, w + " m", m.p, rm.p, n * ms, 1) &&
      same_bytes(rep, w + " v", v.p, rv.p, n * ms, 1) &&
      same_bytes(rep, w + " out", c.out.p, rout.p, n * os, 1) &&
      (!q8 || (same_bytes(rep, w + " m_scale", msc.p, rmsc.p, nb, 4) &&
               same_bytes(rep, w + " v_scale", vsc.p, rvsc.p, nb, 4)));
}

// Every case on table k; `share` > 1 runs every share-th of the Adam and moment cases.
void run_table(const IsaKernels& k, int share) {
  int idx = 0;
  for (int64_t gd : kGD)
    for (int64_t od : kOD)
      for (int variant = 0; variant < 16; ++variant, ++idx) {
        if (idx % share) continue;
        const int64_t n = kSizes[idx % kNSizes], b = idx % 3 == 0 ? (idx % 13) % n : 0;
        adam_case(k, gd, od, variant, idx, n, b, idx % 5);
        if (variant & 2) continue;  // amsgrad: fp32 moments only
        q_case(k, kMomBF16, gd, od, variant, idx, n, (idx / 3) % 2 && n > 600 ? 1 : 0,
               (idx + 1) % 5);
        q_case(k, kMom8, gd, od, variant, idx + 1, n + 257 * (idx % 4), idx % 7 == 1 ? 1 : 0,
               (idx + 2) % 5);
      }
  // several 1024-element chunks, groups with prefetch room
  const int64_t big = share > 1 ? 20011 : 70001;
  for (int64_t gd : kGD)
    for (int64_t od : kOD) {
      idx += 5;
      adam_case(k, gd, od, idx % 16, idx, big, 0, idx % 5);
      idx += 3;
      q_case(k, kMom8, gd, od, idx % 16, idx, big, 0, idx % 5);
      idx += 3;
      if (share == 1) q_case(k, kMomBF16, gd, od, idx % 16, idx, big, 0, idx % 5);
    }
  for (int64_t d : kGD)
    for (int e = 0; e < 12; ++e)
      sumsq_case(rep, k, lanes(k), d, e < 11 ? kSizes[(e * 5) % kNSizes] + 300 * e : 70001, e % 3,
                 e);
  for (int e = 0; e < 12; e += share)
    probe_case(rep, k, kSizes[(e * 7) % kNSizes] + 1000 * (e % 3), e % 4, e);
}

// adam_multi / adam_multi_moments on the dispatched ISA with several threads: their split
// across threads, against the references.
void multi_case() {
  set_pool_size(4);
  for (int64_t gd : kGD) {
    Rng r(77 + static_cast<uint64_t>(gd));
    const int64_t n = 100003;
    Common c(r, n, 1, gd, kBF16);
    Buf<float> m(n, 1), v(n, 1), vmax(n, 1);
    for (int64_t i = 0; i < n; ++i) {
      m[i] = 0.01f;
      v[i] = vmax[i] = 0.001f;
    }
    Buf<float> rp = c.p.clone(0), rm = m.clone(0), rv = v.clone(0), rvmax = vmax.clone(0);
    Buf<unsigned char> rout = c.out.clone(0);
    const AdamHyper h = hyper(3, 1);
    const AdamTask t{c.p.p, m.p, v.p, vmax.p, c.g.p, c.out.p, n, 2, gd, kBF16};
    const AdamTask rt{rp.p, rm.p, rv.p, rvmax.p, c.g.p, rout.p, n, 2, gd, kBF16};
    adam_multi(&t, 1, h, 3);
    adam_multi_reference(&rt, 1, h);
    ++rep.cases;
    const std::string w =
        std::string("adam_multi 3 threads ") + active_kernels().name + " g=" + dtype_name(gd);
    same_bytes(rep, w + " p", c.p.p, rp.p, n, 4) &&
        same_bytes(rep, w + " out", c.out.p, rout.p, 2 * n, 1);
  }
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  for (size_t a = 0; a < s.size();) {
    const size_t e = s.find(',', a);
    out.push_back(s.substr(a, e == std::string::npos ? std::string::npos : e - a));
    a = e == std::string::npos ? s.size() : e + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string expect, full, share;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    (a == "--expect" ? expect : a == "--full" ? full : share) = argv[i + 1];
  }
  std::string avail;
  for (const std::string& s : available_isas()) avail += (avail.empty() ? "" : ",") + s;
  std::printf("sve length %d bits; available %s; chosen %s\n", sve_bits_now(), avail.c_str(),
              active_kernels().name);
  if (!expect.empty() && expect != active_kernels().name)
    rep.fail("dispatch chose " + std::string(active_kernels().name) + ", expected " + expect);
  for (const char* name :
       {"sve128", "sve256", "sve512"}) {  // only the CPU's own length is accepted
    bool ok = true;
    try {
      set_isa(name);
    } catch (const std::invalid_argument&) {
      ok = false;
    }
    if (ok != (avail.find(name) != std::string::npos))
      rep.fail(std::string("set_isa('") + name + "') accepted wrongly");
  }
  set_isa("auto");
  for (const std::string& t : split(full + "," + share))
    if (!t.empty() && !table(t)) {
      std::fprintf(stderr, "no kernel table '%s'\n", t.c_str());
      return 2;
    }
  for (const std::string& t : split(full)) run_table(*table(t), 1);
  for (const std::string& t : split(share)) run_table(*table(t), 4);
  multi_case();
  std::printf("%lld cases, %lld mismatches\n", static_cast<long long>(rep.cases),
              static_cast<long long>(rep.failures));
  return rep.failures ? 1 : 0;
}
