// threadpool.h: a persistent pool of native worker threads (no OpenMP), shared by all kernels.
// run(n, fn) executes fn(0..n-1) with the calling thread as worker 0 and returns when all are
// done. Calls from several Python threads are serialised. Work is split statically by the
// caller, so results never depend on scheduling.
#pragma once
#include <functional>

namespace offload {

// Number of CPUs in this process's affinity mask (what the pool uses by default).
int affinity_cpu_count();

// Current pool size (threads available to one call, the caller included).
int pool_size();
// Resize the pool (1..1024). Idle workers are kept blocked, not spinning.
void set_pool_size(int n);
// Run fn(tid) for tid in [0, nthreads) and wait. nthreads is clamped to [1, pool_size()].
void parallel_run(int nthreads, const std::function<void(int)>& fn);

}  // namespace offload
