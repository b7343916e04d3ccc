// kernels_dtype.h: the dtype side of the Adam kernels. The exact per-vector conversions
// (load_grad, store_out, adopt_user_writes), which (gradient, output) dtype pairs the update loops
// are compiled for (fused_pair: the pairs a training step uses), and the passes that serve every
// other pair with the fp32 loop, kDChunk elements at a time:
//   adopt_chunk  kBF16Sync/kF16Sync: the master takes the user's value where the parameter is not
//                round(master) (common.h), before the update, as the fused loop does first
//   widen_chunk  the gradient widened exactly to fp32 into an L1 buffer (or the fp32 one in place)
//   (the fp32 update loop over the chunk)
//   emit_chunk   out = round(new master), or a plain copy for an fp32 out
// Each element sees the same operations in the same order as in one fused pass, so the results
// are the same bits. Why not fuse every pair: one loop per pair and flag set per ISA made the
// kernels most of the build (18 pairs: ~200 s of compiler time on 2 cores, 4 pairs: ~50 s); why
// not pass every pair: in L2 the passes cost 15-40 % more cycles (bench/moments_ub, AVX-512).
// Included by kernels_impl.h after prefetch_chunk and kQPrefetchAhead.
#pragma once

namespace offload {

template <class I, int GD>
static inline typename I::V load_grad(const void* g, int64_t i) {
  if constexpr (GD == kF32) return I::load(static_cast<const float*>(g) + i);
  else if constexpr (GD == kBF16) return I::load_bf16(static_cast<const uint16_t*>(g) + i);
  else return I::load_f16(static_cast<const uint16_t*>(g) + i);
}

template <class I, int OD>
static inline void store_out(void* out, int64_t i, typename I::V x) {
  if constexpr (OD == kBF16 || OD == kBF16Sync) I::store_bf16(static_cast<uint16_t*>(out) + i, x);
  else if constexpr (OD == kF16 || OD == kF16Sync) I::store_f16(static_cast<uint16_t*>(out) + i, x);
  else if constexpr (OD == kF32) I::store(static_cast<float*>(out) + i, x);
}

// kBF16Sync / kF16Sync (common.h): out is the user's parameter. Lanes whose 16-bit pattern is not
// round(master) were written by the user since the last step: the master takes that value.
// Both sides are widened exactly and compared as bit patterns (so -0 and NaN payloads count).
template <class I, int OD>
static inline typename I::V adopt_user_writes(const void* out, int64_t i, typename I::V p) {
  if constexpr (OD == kBF16Sync) {
    // round(master) widened in registers (no trip through memory): it and the user's widened
    // value are equal bit patterns exactly where the 16-bit patterns are
    const typename I::V user = I::load_bf16(static_cast<const uint16_t*>(out) + i);
    return I::same_bits_select(I::bf16_round_widen(p), user, p, user);
  } else if constexpr (OD == kF16Sync) {
    constexpr int LD = kF16;
    alignas(64) uint16_t mine[I::W];
    store_out<I, LD>(mine, 0, p);
    const typename I::V user = load_grad<I, LD>(out, i);
    return I::same_bits_select(load_grad<I, LD>(mine, 0), user, p, user);
  } else {
    return p;
  }
}

// The (gradient, output) dtype pairs a training step uses, which the vector ISAs run in one fused
// pass: host fp32 parameters (fp32, none), fp32 parameters on a device (fp32, fp32), bf16 ones
// on a device (bf16, bf16) or on the host (bf16, the parameter itself). Everything else (fp16
// parameters, mixed pairs, the scalar ISA but for fp32) runs through the passes: 15-40 % more
// cycles in L2, less where memory bounds the step; one loop per pair and flag set costs build time.
enum FusedPair { kPairNone, kPairF32, kPairF32Out, kPairBF16, kPairBF16Param };
template <class I>
static inline FusedPair fused_pair(int64_t gdtype, int64_t odtype) {
  if (gdtype == kF32 && odtype == kNone) return kPairF32;
  if constexpr (I::W > 1) {
    if (gdtype == kF32 && odtype == kF32) return kPairF32Out;
    if (gdtype == kBF16 && odtype == kBF16) return kPairBF16;
    if (gdtype == kBF16 && odtype == kBF16Sync) return kPairBF16Param;
  }
  return kPairNone;
}

static inline int64_t dtype_bytes(int64_t d) { return d == kF32 ? 4 : (d == kNone ? 0 : 2); }

// Element i of an array of dtype code d (null stays null).
static inline const void* elem_at(const void* a, int64_t d, int64_t i) {
  return a ? static_cast<const char*>(a) + i * dtype_bytes(d) : nullptr;
}
static inline void* elem_at(void* a, int64_t d, int64_t i) {
  return a ? static_cast<char*>(a) + i * dtype_bytes(d) : nullptr;
}

// Elements per chunk of the dtype passes: 4 KiB of widened gradient (L1), a whole number of
// 8-bit moment blocks (kQBlock) and of every loop's vector step.
constexpr int64_t kDChunk = 1024;
// The passes step 64 elements at a time (whole vectors on every ISA), prefetching the lines of
// their stream kQPrefetchAhead elements ahead while below `lim` (the end of the thread's range).
constexpr int64_t kDStep = 64;

template <class I, int GD>
static void widen_t(const void* __restrict g, int64_t c, int64_t n, int64_t lim, float* __restrict buf) {
  constexpr int W = I::W;
  int64_t k = 0;
  for (; k + kDStep <= n; k += kDStep) {
    if (W > 1 && c + k + kDStep + kQPrefetchAhead <= lim) prefetch_chunk<kDStep, 2, false>(g, c + k);
    for (int u = 0; u < kDStep; u += W) I::store(buf + k + u, load_grad<I, GD>(g, c + k + u));
  }
  for (; k < n; ++k) buf[k] = load_grad<ScalarISA, GD>(g, c + k);
}

// Where in `space` (kDChunk + kDSlack floats) the widened gradient goes: the 64-byte-aligned start
// whose address modulo 4 KiB is farthest from those of the fp32 streams the loop stores to at the
// same index (`stores`, null entries ignored). A load whose address matches an earlier, still
// pending store in its low 12 bits waits for it on x86 (4 KiB aliasing); a buffer at a fixed
// place on the stack hit that with some stream of most arrays.
constexpr int64_t kDSlack = 1024;
static inline float* place_chunk_buffer(float* space, const float* const* stores, int nstores) {
  const uintptr_t base = (reinterpret_cast<uintptr_t>(space) + 63) & ~uintptr_t{63};
  uintptr_t best = base;
  int64_t best_gap = -1;
  for (uintptr_t a = base; a < base + 4096; a += 64) {
    int64_t gap = 4096;
    for (int k = 0; k < nstores; ++k) {
      if (!stores[k]) continue;
      const int64_t d = static_cast<int64_t>((a - reinterpret_cast<uintptr_t>(stores[k])) & 4095);
      const int64_t circ = d < 4096 - d ? d : 4096 - d;
      gap = circ < gap ? circ : gap;
    }
    if (gap > best_gap) { best_gap = gap; best = a; }
  }
  return reinterpret_cast<float*>(best);
}

// The fp32 gradient of elements [c, c + n): the array itself if fp32, else `buf` filled.
template <class I>
static const float* widen_chunk(const void* g, int64_t gdtype, int64_t c, int64_t n, int64_t lim, float* buf) {
  if (gdtype == kBF16) widen_t<I, kBF16>(g, c, n, lim, buf);
  else if (gdtype == kF16) widen_t<I, kF16>(g, c, n, lim, buf);
  else return static_cast<const float*>(g) + c;
  return buf;
}

template <class I, int OD>
static void adopt_t(float* __restrict p, const void* __restrict out, int64_t c, int64_t n, int64_t lim) {
  constexpr int W = I::W;
  int64_t k = c;
  const int64_t e = c + n;
  for (; k + kDStep <= e; k += kDStep) {
    if (W > 1 && k + kDStep + kQPrefetchAhead <= lim) prefetch_chunk<kDStep, 2, true>(out, k);  // emit writes it
    for (int u = 0; u < kDStep; u += W) I::store(p + k + u, adopt_user_writes<I, OD>(out, k + u, I::load(p + k + u)));
  }
  for (; k < e; ++k) p[k] = adopt_user_writes<ScalarISA, OD>(out, k, p[k]);
}

// kBF16Sync / kF16Sync: the master of [c, c + n) takes the user's writes; other outputs: nothing.
template <class I>
static void adopt_chunk(float* p, const void* out, int64_t odtype, int64_t c, int64_t n, int64_t lim) {
  if (odtype == kBF16Sync) adopt_t<I, kBF16Sync>(p, out, c, n, lim);
  else if (odtype == kF16Sync) adopt_t<I, kF16Sync>(p, out, c, n, lim);
}

template <class I, int OD, bool PF>
static void emit_t(const float* __restrict p, void* __restrict out, int64_t c, int64_t n, int64_t lim) {
  constexpr int W = I::W;
  int64_t k = c;
  const int64_t e = c + n;
  for (; k + kDStep <= e; k += kDStep) {
    if (PF && W > 1 && k + kDStep + kQPrefetchAhead <= lim) prefetch_chunk<kDStep, OD == kF32 ? 4 : 2, true>(out, k);
    for (int u = 0; u < kDStep; u += W) store_out<I, OD>(out, k + u, I::load(p + k + u));
  }
  for (; k < e; ++k) store_out<ScalarISA, OD>(out, k, p[k]);
}

// out[c, c + n) = the new master in out's dtype (a user's parameter was prefetched by adopt_t).
template <class I>
static void emit_chunk(const float* p, void* out, int64_t odtype, int64_t c, int64_t n, int64_t lim) {
  switch (odtype) {
    case kBF16: return emit_t<I, kBF16, true>(p, out, c, n, lim);
    case kF16: return emit_t<I, kF16, true>(p, out, c, n, lim);
    case kF32: return emit_t<I, kF32, true>(p, out, c, n, lim);
    case kBF16Sync: return emit_t<I, kBF16, false>(p, out, c, n, lim);
    case kF16Sync: return emit_t<I, kF16, false>(p, out, c, n, lim);
    default: return;
  }
}

// Elements [b, e) of one tensor (e: the end of the thread's range) through the passes, kDChunk at a
// time: adopt the user's writes, widen the gradient, loop(c, n, g) (the fp32 update of elements
// [c, c + n) given their fp32 gradient g), write the weight copy. `stores`: the fp32 streams the
// loop stores to, from element b (place_chunk_buffer).
template <class I, class Loop>
static void through_passes(float* p, const void* g, int64_t gdtype, void* out, int64_t odtype, int64_t b, int64_t e,
                           const float* const* stores, int nstores, Loop loop) {
  alignas(64) float space[kDChunk + kDSlack];
  // placed once per call (chunks of a multiple of 4 KiB keep the place); one chunk: not worth the search
  float* const gbuf = e - b > kDChunk ? place_chunk_buffer(space, stores, nstores) : space;
  for (int64_t c = b; c < e; c += kDChunk) {
    const int64_t n = e - c < kDChunk ? e - c : kDChunk;
    adopt_chunk<I>(p, out, odtype, c, n, e);
    loop(c, n, widen_chunk<I>(g, gdtype, c, n, e, gbuf));
    emit_chunk<I>(p, out, odtype, c, n, e);
  }
}

}  // namespace offload
