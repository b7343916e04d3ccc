// adam.cpp: the multi-tensor driver. One call updates a whole list of tensors: the elements of
// all of them are laid end to end, cut into one contiguous range per thread (boundaries on
// 16-element multiples), and each thread walks the tensors its range covers.
#include "adam.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#include "threadpool.h"
#include "validate.h"

namespace offload {

namespace {

constexpr int64_t kMinPerThread = 1 << 15;  // below this, extra threads cost more than they save
constexpr int64_t kAlign = 16;              // one cache line of fp32
constexpr int64_t kStatsBlock = 1 << 16;    // grad_sumsq reduction block (fixed: determinism)

// Thread tid's share [*b, *e) of [0, total) split T ways, boundaries on kAlign multiples.
// T must be the thread count parallel_run passed to the worker, not the count requested.
void thread_range(int64_t total, int tid, int T, int64_t* b, int64_t* e) {
  *b = (total * tid / T) / kAlign * kAlign;
  *e = tid + 1 == T ? total : (total * (tid + 1) / T) / kAlign * kAlign;
}

int threads_for(int64_t total, int nthreads) {
  const int64_t by_size = std::max<int64_t>(1, total / kMinPerThread);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, by_size)));
}

// fn(b, e) on each thread's non-empty share of [0, n) (thread_range's split).
template <class F>
void split_run(int64_t n, int nthreads, const F& fn) {
  parallel_run(threads_for(n, nthreads), [&](int tid, int T) {
    int64_t b, e;
    thread_range(n, tid, T, &b, &e);
    if (b < e) fn(b, e);
  });
}

}  // namespace

void validate_adam(const AdamTask* tasks, int64_t ntasks, const AdamHyper& h) {
  if (ntasks < 0) throw std::invalid_argument("negative tensor count");
  if (ntasks > 0 && tasks == nullptr) throw std::invalid_argument("null task table");
  validate_hyper(h);
  for (int64_t i = 0; i < ntasks; ++i) {
    const AdamTask& t = tasks[i];
    if (t.n < 0) fail(i, "negative length");
    if (t.gdtype != kF32 && t.gdtype != kBF16 && t.gdtype != kF16) fail(i, "invalid gradient dtype code");
    if (t.odtype != kNone && t.odtype != kF32 && t.odtype != kBF16 && t.odtype != kF16 && t.odtype != kBF16Sync &&
        t.odtype != kF16Sync)
      fail(i, "invalid output dtype code");
    if (t.n == 0) continue;
    if (t.step < 1) fail(i, "step must be >= 1");
    if (!t.p || !t.m || !t.v || !t.g) fail(i, "null param/exp_avg/exp_avg_sq/grad pointer");
    if (h.amsgrad && !t.vmax) fail(i, "amsgrad needs a max_exp_avg_sq buffer");
    if (t.odtype != kNone && !t.out) fail(i, "null output pointer");
    if (t.n > (INT64_MAX / 8)) fail(i, "length too large");
    const int64_t fb = t.n * 4;
    const void* written[] = {t.p, t.m, t.v, h.amsgrad ? t.vmax : nullptr, t.out};
    const int64_t wbytes[] = {fb, fb, fb, fb, t.n * elem_size(t.odtype)};
    for (int a = 0; a < 5; ++a) {
      for (int b = a + 1; b < 5; ++b)
        if (overlaps(written[a], wbytes[a], written[b], wbytes[b])) fail(i, "output buffers overlap");
      if (overlaps(written[a], wbytes[a], t.g, t.n * elem_size(t.gdtype)))
        fail(i, "gradient overlaps a written buffer");
    }
  }
}

void adam_multi(const AdamTask* tasks, int64_t ntasks, const AdamHyper& h, int nthreads) {
  validate_adam(tasks, ntasks, h);
  std::vector<int64_t> start(ntasks + 1, 0);
  for (int64_t i = 0; i < ntasks; ++i) start[i + 1] = start[i] + tasks[i].n;
  const int64_t total = start[ntasks];
  if (total == 0) return;
  const IsaKernels& k = active_kernels();
  const bool prefetch = stream_prefetch();

  auto work = [&](int tid, int T) {
    int64_t b, e;
    thread_range(total, tid, T, &b, &e);
    if (b >= e) return;
    // first tensor whose range contains b
    int64_t i = std::upper_bound(start.begin(), start.end(), b) - start.begin() - 1;
    int64_t last_step = -1;
    AdamScalars s{};
    for (; i < ntasks && start[i] < e; ++i) {
      const AdamTask& t = tasks[i];
      if (t.n == 0) continue;
      if (t.step != last_step) { s = make_scalars(h, t.step); s.prefetch = prefetch; last_step = t.step; }
      const int64_t lo = std::max(b, start[i]) - start[i];
      const int64_t hi = std::min(e, start[i + 1]) - start[i];
      k.adam_range(t, s, lo, hi);
    }
  };
  parallel_run(threads_for(total, nthreads), work);
}

void adam_multi_reference(const AdamTask* tasks, int64_t ntasks, const AdamHyper& h) {
  validate_adam(tasks, ntasks, h);
  for (int64_t i = 0; i < ntasks; ++i)
    if (tasks[i].n > 0) adam_reference(tasks[i], h);
}

double grad_sumsq(const GradTask* tasks, int64_t ntasks, int nthreads) {
  if (ntasks < 0) throw std::invalid_argument("negative tensor count");
  if (ntasks > 0 && tasks == nullptr) throw std::invalid_argument("null task table");
  struct Block { int64_t task, b, e; };
  std::vector<Block> blocks;
  int64_t total = 0;
  for (int64_t i = 0; i < ntasks; ++i) {
    const GradTask& t = tasks[i];
    if (t.n < 0) fail(i, "negative length");
    if (t.dtype != kF32 && t.dtype != kBF16 && t.dtype != kF16) fail(i, "invalid gradient dtype code");
    if (t.n == 0) continue;
    if (!t.g) fail(i, "null gradient pointer");
    for (int64_t b = 0; b < t.n; b += kStatsBlock) blocks.push_back({i, b, std::min(t.n, b + kStatsBlock)});
    total += t.n;
  }
  if (blocks.empty()) return 0.0;
  std::vector<double> partial(blocks.size(), 0.0);
  const IsaKernels& k = active_kernels();
  const int64_t nb = static_cast<int64_t>(blocks.size());
  parallel_run(threads_for(total, nthreads), [&](int tid, int T) {
    const int64_t lo = nb * tid / T, hi = nb * (tid + 1) / T;
    for (int64_t j = lo; j < hi; ++j) {
      const GradTask& t = tasks[blocks[j].task];
      partial[j] = k.sumsq(t.g, t.dtype, blocks[j].b, blocks[j].e);
    }
  });
  double sum = 0.0;
  for (double x : partial) sum += x;
  return sum;
}

// kProbeTiles: 1 MiB of each fp32 stream; thread t takes tiles t, t + T, ...
constexpr int64_t kProbeTile = 1 << 18;

void bandwidth_probe(float* p, float* m, float* v, const float* g, int64_t n, int nthreads, int mode) {
  if (n < 0) throw std::invalid_argument("negative length");
  if (mode < 0 || mode >= kProbeModes) throw std::invalid_argument("unknown probe mode");
  if (n > 0 && (!p || !m || !v || !g)) throw std::invalid_argument("null pointer");
  if (n == 0) return;
  const IsaKernels& k = active_kernels();
  if (mode != kProbeTiles) {
    split_run(n, nthreads, [&](int64_t b, int64_t e) { k.probe(p, m, v, g, b, e, mode); });
    return;
  }
  parallel_run(threads_for(n, nthreads), [&](int tid, int T) {
    for (int64_t b = tid * kProbeTile; b < n; b += T * kProbeTile)
      k.probe(p, m, v, g, b, std::min(n, b + kProbeTile), kProbeFused);
  });
}

void bandwidth_probe_fmt(float* p, void* m, void* v, const void* g, void* out, int64_t n, int64_t mbytes,
                         int64_t gbytes, int nthreads, int mode) {
  if (n < 0) throw std::invalid_argument("negative length");
  if (mode != kProbeFused && mode != kProbeHwOnly && mode != kProbeTiles)
    throw std::invalid_argument("unknown probe mode for the moment probe (0, 1 or 2)");
  if (mbytes != 1 && mbytes != 2 && mbytes != 4) throw std::invalid_argument("moment element size must be 1, 2 or 4");
  if (gbytes != 2 && gbytes != 4) throw std::invalid_argument("gradient element size must be 2 or 4");
  if (n > 0 && (!p || !m || !v || !g)) throw std::invalid_argument("null pointer");
  if (n == 0) return;
  const IsaKernels& k = active_kernels();
  const bool pf = mode != kProbeHwOnly;
  if (mode != kProbeTiles) {
    split_run(n, nthreads, [&](int64_t b, int64_t e) { k.probe_fmt(p, m, v, g, out, mbytes, gbytes, b, e, pf); });
    return;
  }
  parallel_run(threads_for(n, nthreads), [&](int tid, int T) {
    for (int64_t b = tid * kProbeTile; b < n; b += T * kProbeTile)
      k.probe_fmt(p, m, v, g, out, mbytes, gbytes, b, std::min(n, b + kProbeTile), true);
  });
}

int64_t fingerprint_bytes(const void* p, int64_t nbytes) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  const int64_t words = nbytes / 4;
  // word i (as int32) times its odd int32 weight, exactly in 64 bits (|product| < 2^62), summed
  // mod 2^64: a change d_i of each word changes the sum by sum(w_i * d_i) mod 2^64. Products that
  // wrapped mod 2^32 (before) made the carries of a uniform change (p.data.mul_(0.5): every word
  // -2^23) a random walk that cancelled in 1-3 % of power-of-two-sized tensors.
  auto term = [](uint32_t w, int64_t i) {
    const int32_t weight = static_cast<int32_t>((static_cast<uint32_t>(i) * 2654435761u + 0x9E3779B9u) | 1u);
    return static_cast<uint64_t>(static_cast<int64_t>(static_cast<int32_t>(w)) * static_cast<int64_t>(weight));
  };
  uint64_t h = 0;
  for (int64_t i = 0; i < words; ++i) {
    uint32_t w;
    std::memcpy(&w, b + 4 * i, 4);
    h += term(w, i);
  }
  if (nbytes % 4) {
    uint32_t w = 0;
    std::memcpy(&w, b + 4 * words, static_cast<size_t>(nbytes % 4));
    h += term(w, words);
  }
  return static_cast<int64_t>(h);
}

}  // namespace offload
