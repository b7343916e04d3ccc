// tools/arm/driver_inputs.h: the inputs of the aarch64 bitwise driver (driver.cpp): buffers at a
// chosen misalignment, random values mixed with edge values (NaN of both signs and assorted
// payloads, infinities, subnormals, signed zeros, bf16 and fp16 rounding ties, the fp16 overflow
// and subnormal edges), and byte-exact comparison with the first difference reported.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace armcheck {

using offload::bits_f32;
using offload::f32_bits;

// n elements of T starting `off` elements past a 64-byte boundary (misaligned starts).
template <class T>
struct Buf {
  std::vector<unsigned char> raw;
  T* p = nullptr;
  int64_t n = 0;
  Buf() = default;
  Buf(int64_t count, int off) : raw(static_cast<size_t>(count + off) * sizeof(T) + 128), n(count) {
    const uintptr_t a = (reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t{63};
    p = reinterpret_cast<T*>(a) + off;
  }
  Buf(Buf&&) = default;  // (the vector's storage, and so p, stays where it is)
  Buf& operator=(Buf&&) = default;
  Buf(const Buf&) = delete;
  // The same contents at another misalignment.
  Buf clone(int off) const {
    Buf c(n, off);
    for (int64_t i = 0; i < n; ++i) c.p[i] = p[i];
    return c;
  }
  T& operator[](int64_t i) { return p[i]; }
};

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(gen); }
  double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(gen); }
  uint32_t bits() { return static_cast<uint32_t>(gen()); }
  int below(int k) { return static_cast<int>(gen() % static_cast<uint64_t>(k)); }
};

// Words every special value is drawn from: NaNs (quiet, signalling, both signs, payloads),
// infinities, subnormals, zeros, the fp16 edges (65504, 65519.99 / 65520 around its overflow,
// its smallest subnormal and half of it), exact bf16 ties with even and odd kept bits.
inline const std::vector<uint32_t>& special_words() {
  static const std::vector<uint32_t> w = {
      0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFA12345, 0x7FC0FFEE,  // NaNs
      0x7F800000, 0xFF800000,                                                  // infinities
      0x00000001, 0x807FFFFF, 0x00400000, 0x80000010,                          // subnormals
      0x00000000, 0x80000000,                                                  // zeros
      0x477FE000, 0x477FEFFF, 0x477FF000, 0xC77FF000, 0x33800000, 0x33000000,  // fp16 edges
      0x33000001, 0x387FE000, 0x38800000, 0x3F808000, 0x3F818000, 0xBF808000,  // fp16/bf16 ties
      0x3F800FFF, 0x3F801000, 0x3F803000, 0x7F7F8000, 0x7F7FFFFF, 0x00018000,  // more ties, max
  };
  return w;
}

// Bytes per element of a dtype code (common.h).
inline int64_t dsize(int64_t d) { return d == offload::kNone ? 0 : (d == offload::kF32 ? 4 : 2); }

// The kernel table of an ISA name (any of aarch64's, whether or not this CPU runs it natively).
inline const offload::IsaKernels* table(const std::string& name) {
  using namespace offload;
  for (const IsaKernels* k :
       {&kernels_scalar, &kernels_neon, &kernels_sve128, &kernels_sve256, &kernels_sve512})
    if (name == k->name) return k;
  return nullptr;
}

// A random float: mostly N(0, scale^2), sometimes a random finite bit pattern, a bf16 tie or an
// fp16 tie (for the output rounding), or (if `special`) an edge word.
inline float value(Rng& r, double scale, bool special) {
  const int k = r.below(20);
  if (special && k == 0)
    return bits_f32(special_words()[r.below(static_cast<int>(special_words().size()))]);
  if (k == 1) {  // a finite random pattern
    uint32_t u;
    do u = r.bits();
    while ((u & 0x7F800000u) == 0x7F800000u);
    return bits_f32(u);
  }
  const float x = static_cast<float>(r.normal() * scale);
  if (k == 2) return bits_f32((f32_bits(x) & 0xFFFF0000u) | 0x8000u);  // bf16 tie
  if (k == 3) return bits_f32((f32_bits(x) & 0xFFFFE000u) | 0x1000u);  // fp16 tie (normal range)
  return x;
}

// A 16-bit word widened exactly (common.h): bf16 or fp16.
inline float widen16(uint16_t w, bool bf16) {
  return bf16 ? offload::bf16_to_f32(w) : offload::f16_to_f32(w);
}

// A 16-bit gradient word: mostly a rounded N(0, 9), sometimes any pattern (NaN, inf, subnormal).
inline uint16_t half_word(Rng& r, bool bf16) {
  if (r.below(10) == 0) return static_cast<uint16_t>(r.bits());
  const float x = static_cast<float>(r.normal() * 3.0);
  return bf16 ? offload::f32_to_bf16(x) : offload::f32_to_f16(x);
}

// Failures are counted and the first few printed; main() exits non-zero if any.
struct Report {
  int64_t cases = 0, failures = 0;
  void fail(const std::string& what) {
    if (++failures <= 20) std::printf("MISMATCH %s\n", what.c_str());
  }
};

// Byte-exact equality of n elements of `size` bytes; the first differing element is reported.
inline bool same_bytes(Report& rep, const std::string& what, const void* a, const void* b,
                       int64_t n, int size) {
  if (n <= 0 || std::memcmp(a, b, static_cast<size_t>(n * size)) == 0) return true;
  const unsigned char* x = static_cast<const unsigned char*>(a);
  const unsigned char* y = static_cast<const unsigned char*>(b);
  int64_t i = 0;
  while (std::memcmp(x + i * size, y + i * size, static_cast<size_t>(size)) == 0) ++i;
  uint32_t u = 0, v = 0;
  std::memcpy(&u, x + i * size, static_cast<size_t>(size));
  std::memcpy(&v, y + i * size, static_cast<size_t>(size));
  char buf[160];
  std::snprintf(buf, sizeof buf, " element %lld of %lld: 0x%08x, expected 0x%08x",
                static_cast<long long>(i), static_cast<long long>(n), u, v);
  rep.fail(what + buf);
  return false;
}

}  // namespace armcheck
