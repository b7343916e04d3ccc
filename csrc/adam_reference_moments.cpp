// adam_reference_moments.cpp: the plain scalar reference of the Adam update over compressed
// moments (moments.h), one element at a time, written from the format description; it shares
// no code with the fast paths (only the exact bf16 conversions). Tests check every ISA's
// kernels_moments.h against it bit for bit.
#include <cfloat>
#include <cmath>
#include <cstring>

#include "moments.h"

namespace offload {

namespace {

float rne_clamp(float x, float lo, float hi) {
  const float r = std::nearbyint(x);  // default rounding mode: to nearest, ties to even
  return r > hi ? hi : (r < lo ? lo : r);
}

// moments.h's bit shifts of a float's pattern.
float shr1(float x) { return bits_f32(f32_bits(x) >> 1); }
float shl1(float x) { return bits_f32(f32_bits(x) << 1); }

}  // namespace

void adam_reference_moments(const AdamQTask& t, const AdamHyper& h) {
  const double bias_correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(t.step));
  const double bias_correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(t.step));
  const float step_size = static_cast<float>(h.lr / bias_correction1);
  const float inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bias_correction2));  // as adam_reference
  const float weight = static_cast<float>(1.0 - h.beta1);
  const float beta2 = static_cast<float>(h.beta2);
  const float one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  const float eps = static_cast<float>(h.eps);
  const float wd = static_cast<float>(h.weight_decay);
  const float decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const float mult = static_cast<float>(h.grad_multiplier);
  const bool q8 = t.mfmt == kMom8;
  float newm[kQBlock], newu[kQBlock];

  for (int64_t b0 = 0; b0 < t.n; b0 += kQBlock) {
    const int64_t blk = b0 / kQBlock;
    const int64_t len = t.n - b0 < kQBlock ? t.n - b0 : kQBlock;
    float max_m = 0.0f, max_u = 0.0f;
    bool bad = false;
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = b0 + k;
      float m, v;
      if (q8) {
        const float x = static_cast<float>(static_cast<const int8_t*>(t.m)[i]) * (t.m_scale[blk] / 127.0f);
        m = bits_f32((f32_bits(x) << 1) | (f32_bits(x) & 0x80000000u));  // shl1(|x|), x's sign
        const float w = static_cast<float>(static_cast<const uint8_t*>(t.v)[i]) * (t.v_scale[blk] / 255.0f);
        const float s = shl1(w);
        v = s * s;
      } else {
        m = bf16_to_f32(static_cast<const uint16_t*>(t.m)[i]);
        v = bf16_to_f32(static_cast<const uint16_t*>(t.v)[i]);
      }
      float g = load_grad_scalar(t.g, t.gdtype, i);
      if (h.grad_multiplier != 1.0) g = g * mult;
      if (h.maximize) g = -g;
      float p = adopt_user_write(t.p[i], t.out, t.odtype, i);
      if (h.weight_decay != 0.0) {
        if (h.decoupled) p = p * decay;
        else g = g + wd * p;
      }
      if (std::fabs(1.0 - h.beta1) < 0.5) m = m + weight * (g - m);
      else m = g - (g - m) * (1.0f - weight);
      v = v * beta2 + (one_minus_beta2 * g) * g;
      const float sv = std::sqrt(v);
      p = p + ((-step_size) * m) / (sv * inv_bc2_sqrt + eps);
      t.p[i] = p;
      store_out_scalar(t.out, t.odtype, i, p);
      if (!q8) {
        static_cast<uint16_t*>(t.m)[i] = f32_to_bf16(m);
        static_cast<uint16_t*>(t.v)[i] = f32_to_bf16(v);
        continue;
      }
      const float u = shr1(sv);
      const float r = shr1(std::fabs(m));  // stored with m's sign
      newm[k] = std::copysign(r, m);
      newu[k] = u;
      if (!std::isfinite(m) || !std::isfinite(v)) bad = true;
      else {
        if (r > max_m) max_m = r;
        if (u > max_u) max_u = u;
      }
    }
    if (!q8) continue;
    int8_t* qm = static_cast<int8_t*>(t.m) + b0;
    uint8_t* qv = static_cast<uint8_t*>(t.v) + b0;
    if (bad) {
      std::memset(qm, 0, len);
      std::memset(qv, 0, len);
      t.m_scale[blk] = t.v_scale[blk] = bits_f32(kQPoisonScale);
      continue;
    }
    const float im = max_m > 0.0f ? std::fmin(127.0f / max_m, FLT_MAX) : 0.0f;
    const float iu = max_u > 0.0f ? std::fmin(255.0f / max_u, FLT_MAX) : 0.0f;
    for (int64_t k = 0; k < len; ++k) {
      qm[k] = static_cast<int8_t>(rne_clamp(newm[k] * im, -127.0f, 127.0f));
      qv[k] = static_cast<uint8_t>(rne_clamp(newu[k] * iu, 0.0f, 255.0f));
    }
    t.m_scale[blk] = max_m;
    t.v_scale[blk] = max_u;
  }
}

}  // namespace offload
