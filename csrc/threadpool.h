// threadpool.h: a persistent pool of native worker threads (no OpenMP), shared by all kernels.
// parallel_run(n, fn) executes fn(tid, T) for tid in [0, T) with the calling thread as worker 0
// and returns when all are done; T is the number of threads that actually run (n clamped to the
// pool), and callers must split their work by T, never by the n they asked for (a
// split by n skipped the shares of the threads that never ran). Calls from several Python
// threads are serialised. Work is split statically by the caller, so results never depend on
// scheduling.
#pragma once
#include <functional>

namespace offload {

// Number of CPUs in this process's affinity mask (what the pool uses by default).
int affinity_cpu_count();

// Current pool size (threads available to one call, the caller included).
int pool_size();
// Resize the pool (1..1024). Idle workers are kept blocked, not spinning.
void set_pool_size(int n);
// Run fn(tid, T) for tid in [0, T) and wait, where T = nthreads clamped to [1, pool size]
// (decided under the pool's lock, so a concurrent resize cannot change it mid-call).
void parallel_run(int nthreads, const std::function<void(int tid, int nthreads)>& fn);

// Test hook: hold the pool's global lock for `seconds` (tests/test_threadpool_fork.py forks
// while another thread holds it).
void debug_hold_pool_lock(double seconds);

}  // namespace offload
