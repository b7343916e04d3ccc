// adam_reference.cpp: the plain scalar reference Adam/AdamW, one element at a time, written
// straight from torch.optim.adam._single_tensor_adam. It shares no code with the fast paths
// (only the exact bf16/fp16 conversions), so tests can check every SIMD path against it.
#include <cmath>

#include "kernels.h"

namespace offload {

void adam_reference(const AdamTask& t, const AdamHyper& h) {
  // Scalars in double, rounded to float once, as torch does with Python-float hyperparameters.
  const double bias_correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(t.step));
  const double bias_correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(t.step));
  const float step_size = static_cast<float>(h.lr / bias_correction1);
  // reciprocal of sqrt(bias_correction2): the kernels multiply by it (see kernels_impl.h)
  const float inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  const float eps = static_cast<float>(h.eps);
  const float weight = static_cast<float>(1.0 - h.beta1);
  const float beta2 = static_cast<float>(h.beta2);
  const float one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  const float wd = static_cast<float>(h.weight_decay);
  const float decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const float mult = static_cast<float>(h.grad_multiplier);

  for (int64_t i = 0; i < t.n; ++i) {
    float g = load_grad_scalar(t.g, t.gdtype, i);
    if (h.grad_multiplier != 1.0) g = g * mult;
    if (h.maximize) g = -g;

    float p = adopt_user_write(t.p[i], t.out, t.odtype, i);
    if (h.weight_decay != 0.0) {
      if (h.decoupled) p = p * decay;  // param.mul_(1 - lr * wd)
      else g = g + wd * p;             // grad.add(param, alpha=wd)
    }
    // exp_avg.lerp_(grad, 1 - beta1): torch uses the other form when weight >= 0.5
    float m = t.m[i];
    if (std::fabs(1.0 - h.beta1) < 0.5) m = m + weight * (g - m);
    else m = g - (g - m) * (1.0f - weight);
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    float v = t.v[i] * beta2 + (one_minus_beta2 * g) * g;
    float vv = v;
    if (h.amsgrad) {
      const float old = t.vmax[i];
      if (std::isnan(old)) vv = old;        // torch.maximum propagates NaN
      else if (std::isnan(v)) vv = v;
      else vv = old > v ? old : v;
      t.vmax[i] = vv;
    }
    // torch: denom = (v.sqrt() / bc2_sqrt).add_(eps); param.addcdiv_(exp_avg, denom, value=-step_size)
    // here sqrt(v) * (1 / bc2_sqrt) instead of the division
    const float denom = std::sqrt(vv) * inv_bc2_sqrt + eps;
    p = p + ((-step_size) * m) / denom;
    t.m[i] = m;
    t.v[i] = v;
    t.p[i] = p;
    store_out_scalar(t.out, t.odtype, i, p);
  }
}

}  // namespace offload
