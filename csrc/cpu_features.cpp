// cpu_features.cpp: runtime instruction-set detection and the choice of kernel table.
// x86-64: __builtin_cpu_supports also checks that the OS saves the AVX/AVX-512 register state.
// aarch64: the kernel's hardware capabilities (getauxval(AT_HWCAP): ASIMD, SVE) and the SVE
// vector length of the calling thread (prctl(PR_SVE_GET_VL)), which picks the SVE build. At 128
// bits (Grace, Graviton 4) NEON is preferred: the same width, and in every loop fewer
// instructions per element than the 128-bit SVE build (no paired loads and stores in SVE, a
// MOVPRFX before each destructive operation; counted under qemu: docs/benchmarks.md).
#include <atomic>
#include <stdexcept>

#include "kernels.h"

#if defined(__aarch64__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP_SVE
#define HWCAP_SVE (1 << 22)
#endif
#ifndef PR_SVE_GET_VL
#define PR_SVE_GET_VL 51
#endif
#ifndef PR_SVE_VL_LEN_MASK
#define PR_SVE_VL_LEN_MASK 0xffff
#endif
#endif

namespace offload {

namespace {

#if defined(__x86_64__) || defined(__i386__)
#define OFFLOAD_X86 1
bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
}
#endif

#if defined(__aarch64__)
bool cpu_has_neon() { return (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0; }

// The calling thread's SVE vector length in bits, 0 without SVE.
int sve_bits() {
  if (!cpu_has_neon() || !(getauxval(AT_HWCAP) & HWCAP_SVE)) return 0;
  const int vl = prctl(PR_SVE_GET_VL, 0, 0, 0, 0);
  return vl < 0 ? 0 : (vl & PR_SVE_VL_LEN_MASK) * 8;
}

// The SVE build for this vector length (128, 256 or 512 bits), else null.
const IsaKernels* sve_kernels() {
  switch (sve_bits()) {
    case 128: return &kernels_sve128;
    case 256: return &kernels_sve256;
    case 512: return &kernels_sve512;
    default: return nullptr;
  }
}
#endif

// The best ISA of this CPU; any other architecture: scalar.
const IsaKernels* best() {
#if defined(OFFLOAD_X86)
  if (cpu_has_avx512()) return &kernels_avx512;
  if (cpu_has_avx2()) return &kernels_avx2;
#elif defined(__aarch64__)
  const IsaKernels* sve = sve_kernels();
  if (sve && sve != &kernels_sve128) return sve;
  if (cpu_has_neon()) return &kernels_neon;
#endif
  return &kernels_scalar;
}

// The kernels of a vector ISA's name, null if this CPU (or build) has not got it; *why says
// what this CPU lacks where that is more than the name.
const IsaKernels* vector_isa(const std::string& name, std::string* why) {
#if defined(OFFLOAD_X86)
  if (name == "avx2") return cpu_has_avx2() ? &kernels_avx2 : nullptr;
  if (name == "avx512") return cpu_has_avx512() ? &kernels_avx512 : nullptr;
#elif defined(__aarch64__)
  if (name == "neon") return cpu_has_neon() ? &kernels_neon : nullptr;
  if (name.rfind("sve", 0) == 0) {
    const int bits = sve_bits();
    *why = bits ? " (its SVE vector length is " + std::to_string(bits) + " bits)" : " (no SVE)";
    const IsaKernels* sve = sve_kernels();
    return sve && name == sve->name ? sve : nullptr;
  }
#endif
  (void)name;
  (void)why;
  return nullptr;
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
#if defined(OFFLOAD_X86)
  if (cpu_has_avx2()) out.emplace_back("avx2");
  if (cpu_has_avx512()) out.emplace_back("avx512");
#elif defined(__aarch64__)
  const IsaKernels* sve = sve_kernels();
  if (sve == &kernels_sve128) out.emplace_back(sve->name);  // (below NEON: best())
  if (cpu_has_neon()) out.emplace_back("neon");
  if (sve && sve != &kernels_sve128) out.emplace_back(sve->name);
#endif
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
  std::string why;
  if (name == "scalar") k = &kernels_scalar;
  else if (name == "auto" || name.empty()) k = best();
  else if (name == "avx2" || name == "avx512" || name == "neon" || name == "sve128" ||
           name == "sve256" || name == "sve512")
    k = vector_isa(name, &why);
  else
    throw std::invalid_argument("unknown ISA '" + name + "' (expected scalar, avx2, avx512, neon, "
                                "sve128, sve256, sve512 or auto)");
  if (k == nullptr)
    throw std::invalid_argument("ISA '" + name + "' is not supported by this CPU" + why);
  g_active.store(k);
}

}  // namespace offload
