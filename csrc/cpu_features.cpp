// cpu_features.cpp: runtime instruction-set detection and the choice of kernel table.
// __builtin_cpu_supports also checks that the OS saves the AVX/AVX-512 register state.
#include <atomic>
#include <stdexcept>

#include "kernels.h"

namespace offload {

namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

const IsaKernels* best() {
  if (cpu_has_avx512()) return &kernels_avx512;
  if (cpu_has_avx2()) return &kernels_avx2;
  return &kernels_scalar;
}

std::atomic<const IsaKernels*> g_active{nullptr};

bool auto_prefetch() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return !__builtin_cpu_is("amd");
#else
  return true;
#endif
}

std::atomic<int> g_prefetch{-1};  // -1 auto, 0 off, 1 on

}  // namespace

bool stream_prefetch() {
  const int m = g_prefetch.load();
  return m < 0 ? auto_prefetch() : m == 1;
}

void set_stream_prefetch(const std::string& mode) {
  if (mode == "auto" || mode.empty()) g_prefetch.store(-1);
  else if (mode == "on") g_prefetch.store(1);
  else if (mode == "off") g_prefetch.store(0);
  else throw std::invalid_argument("unknown prefetch setting '" + mode + "' (expected on, off or auto)");
}

std::string stream_prefetch_mode() {
  const int m = g_prefetch.load();
  return m < 0 ? "auto" : (m == 1 ? "on" : "off");
}

std::vector<std::string> available_isas() {
  std::vector<std::string> out{"scalar"};
  if (cpu_has_avx2()) out.emplace_back("avx2");
  if (cpu_has_avx512()) out.emplace_back("avx512");
  return out;
}

const IsaKernels& active_kernels() {
  const IsaKernels* k = g_active.load();
  if (k == nullptr) {
    k = best();
    g_active.store(k);
  }
  return *k;
}

void set_isa(const std::string& name) {
  const IsaKernels* k = nullptr;
  if (name == "scalar") k = &kernels_scalar;
  else if (name == "avx2") k = cpu_has_avx2() ? &kernels_avx2 : nullptr;
  else if (name == "avx512") k = cpu_has_avx512() ? &kernels_avx512 : nullptr;
  else if (name == "auto" || name.empty()) k = best();
  else throw std::invalid_argument("unknown ISA '" + name + "' (expected scalar, avx2, avx512 or auto)");
  if (k == nullptr) throw std::invalid_argument("ISA '" + name + "' is not supported by this CPU");
  g_active.store(k);
}

}  // namespace offload
