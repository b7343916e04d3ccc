// moments.cpp: the multi-tensor driver of the compressed-moment Adam (formats in moments.h).
// Every tensor is cut into 256-element blocks, the blocks of all tensors are laid end to end
// and split into one contiguous run per thread, so a thread boundary never falls inside a
// block: results are bitwise identical for any thread count.
#include "moments.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#include "threadpool.h"
#include "validate.h"

namespace offload {

namespace {

constexpr int64_t kMinBlocksPerThread = 128;  // 32K elements: below this one thread is cheaper

}  // namespace

void validate_adam_moments(const AdamQTask* tasks, int64_t ntasks, const AdamHyper& h) {
  if (ntasks < 0) throw std::invalid_argument("negative tensor count");
  if (ntasks > 0 && tasks == nullptr) throw std::invalid_argument("null task table");
  if (h.amsgrad)
    throw std::invalid_argument("amsgrad is not supported with compressed (bf16/8bit) moments: "
                                "use fp32 moments (moments='fp32') for amsgrad=True");
  validate_hyper(h);
  for (int64_t i = 0; i < ntasks; ++i) {
    const AdamQTask& t = tasks[i];
    if (t.n < 0) fail(i, "negative length");
    if (t.gdtype != kF32 && t.gdtype != kBF16 && t.gdtype != kF16) fail(i, "invalid gradient dtype code");
    if (t.odtype != kNone && t.odtype != kF32 && t.odtype != kBF16 && t.odtype != kF16 && t.odtype != kBF16Sync &&
        t.odtype != kF16Sync)
      fail(i, "invalid output dtype code");
    if (t.mfmt != kMomBF16 && t.mfmt != kMom8)
      fail(i, "invalid moment format code " + std::to_string(t.mfmt) + " (2 = bf16, 8 = 8bit)");
    if (t.n == 0) continue;
    if (t.step < 1) fail(i, "step must be >= 1");
    if (t.n > (INT64_MAX / 8)) fail(i, "length too large");
    if (!t.p || !t.m || !t.v || !t.g) fail(i, "null param/exp_avg/exp_avg_sq/grad pointer");
    const bool q8 = t.mfmt == kMom8;
    if (q8 && (!t.m_scale || !t.v_scale)) fail(i, "8bit moments need m_scale and v_scale buffers");
    if (t.odtype != kNone && !t.out) fail(i, "null output pointer");
    const int64_t mb = t.n * (q8 ? 1 : 2), sb = q8 ? q_blocks(t.n) * 4 : 0;
    const void* written[] = {t.p, t.m, t.v, q8 ? t.m_scale : nullptr, q8 ? t.v_scale : nullptr, t.out};
    const int64_t wbytes[] = {t.n * 4, mb, mb, sb, sb, t.n * elem_size(t.odtype)};
    for (int a = 0; a < 6; ++a) {
      for (int b = a + 1; b < 6; ++b)
        if (overlaps(written[a], wbytes[a], written[b], wbytes[b])) fail(i, "output buffers overlap");
      if (overlaps(written[a], wbytes[a], t.g, t.n * elem_size(t.gdtype))) fail(i, "gradient overlaps a written buffer");
    }
  }
}

void adam_multi_moments(const AdamQTask* tasks, int64_t ntasks, const AdamHyper& h, int nthreads) {
  validate_adam_moments(tasks, ntasks, h);
  std::vector<int64_t> start(ntasks + 1, 0);  // first global block of each tensor
  for (int64_t i = 0; i < ntasks; ++i) start[i + 1] = start[i] + q_blocks(tasks[i].n);
  const int64_t total = start[ntasks];
  if (total == 0) return;
  const IsaKernels& k = active_kernels();
  const int want = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, total / kMinBlocksPerThread)));
  parallel_run(want, [&](int tid, int T) {  // split by T, the threads that actually run
    const int64_t b = total * tid / T, e = total * (tid + 1) / T;
    if (b >= e) return;
    int64_t i = std::upper_bound(start.begin(), start.end(), b) - start.begin() - 1;
    int64_t last_step = -1;
    AdamScalars s{};
    for (; i < ntasks && start[i] < e; ++i) {
      const AdamQTask& t = tasks[i];
      if (t.n == 0) continue;
      if (t.step != last_step) { s = make_scalars(h, t.step); last_step = t.step; }
      k.adam_q_range(t, s, std::max(b, start[i]) - start[i], std::min(e, start[i + 1]) - start[i]);
    }
  });
}

void adam_multi_moments_reference(const AdamQTask* tasks, int64_t ntasks, const AdamHyper& h) {
  validate_adam_moments(tasks, ntasks, h);
  for (int64_t i = 0; i < ntasks; ++i)
    if (tasks[i].n > 0) adam_reference_moments(tasks[i], h);
}

}  // namespace offload
