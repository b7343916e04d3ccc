// validate.h: the checks shared by the fp32-moment (adam.cpp) and compressed-moment (moments.cpp)
// multi-tensor drivers: per-task failure message, buffer overlap, element sizes, hyperparameters.
#pragma once
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common.h"

namespace offload {

[[noreturn]] inline void fail(int64_t i, const std::string& what) {
  throw std::invalid_argument("tensor " + std::to_string(i) + ": " + what);
}

inline bool overlaps(const void* a, int64_t abytes, const void* b, int64_t bbytes) {
  if (a == nullptr || b == nullptr || abytes == 0 || bbytes == 0) return false;
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + static_cast<uintptr_t>(bbytes) && y < x + static_cast<uintptr_t>(abytes);
}

inline int64_t elem_size(int64_t dtype) { return dtype == kF32 ? 4 : (dtype == kNone ? 0 : 2); }

inline void check_finite(double x, const char* name) {
  if (!std::isfinite(x)) throw std::invalid_argument(std::string("Invalid ") + name + ": " + std::to_string(x));
}

// The same checks and messages as torch.optim.Adam, plus finite values (the kernel computes in fp32).
inline void validate_hyper(const AdamHyper& h) {
  check_finite(h.lr, "learning rate");
  check_finite(h.eps, "epsilon value");
  check_finite(h.weight_decay, "weight_decay value");
  check_finite(h.grad_multiplier, "grad_multiplier");
  if (h.lr < 0) throw std::invalid_argument("Invalid learning rate: " + std::to_string(h.lr));
  if (h.eps < 0) throw std::invalid_argument("Invalid epsilon value: " + std::to_string(h.eps));
  if (h.weight_decay < 0) throw std::invalid_argument("Invalid weight_decay value: " + std::to_string(h.weight_decay));
  if (!(h.beta1 >= 0 && h.beta1 < 1)) throw std::invalid_argument("Invalid beta parameter at index 0: " + std::to_string(h.beta1));
  if (!(h.beta2 >= 0 && h.beta2 < 1)) throw std::invalid_argument("Invalid beta parameter at index 1: " + std::to_string(h.beta2));
}

}  // namespace offload
