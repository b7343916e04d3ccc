// threadpool.cpp: see threadpool.h. Workers sleep on a condition variable between jobs; a job
// is published by bumping a generation counter. After fork() the child has no workers, so the
// pool notices the pid change and starts fresh (the old one is leaked on purpose). The global
// lock that guards the pool pointer is held across fork() (pthread_atfork), so a child forked
// while another thread was inside pool() never inherits it locked.
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace offload {

int affinity_cpu_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned hc = std::thread::hardware_concurrency();
  return hc ? static_cast<int>(hc) : 1;
}

namespace {

class Pool {
 public:
  explicit Pool(int n) : pid_(getpid()) { resize_locked(n); }

  pid_t pid() const { return pid_; }
  int size() const { return size_.load(); }

  void resize(int n) {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    resize_locked(n);
  }

  void run(int nthreads, const std::function<void(int, int)>& fn) {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    nthreads = std::max(1, std::min({nthreads, size_.load(), static_cast<int>(workers_.size()) + 1}));
    if (nthreads == 1) { fn(0, 1); return; }
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &fn;
      job_threads_ = nthreads;
      pending_ = nthreads - 1;
      ++generation_;
    }
    cv_work_.notify_all();
    fn(0, nthreads);
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  void resize_locked(int n) {
    n = std::max(1, std::min(n, 1024));
    // Grow only: shrinking just means later calls use fewer workers.
    while (static_cast<int>(workers_.size()) + 1 < n) {
      const int tid = static_cast<int>(workers_.size()) + 1;
      uint64_t gen;
      {
        std::lock_guard<std::mutex> lk(mu_);
        gen = generation_;  // no job is in flight (run_mu_ is held), so this is current
      }
      workers_.emplace_back([this, tid, gen] { loop(tid, gen); });
      workers_.back().detach();
    }
    size_.store(n);
  }

  // `seen` is the generation at creation: a job published before this thread first takes the
  // lock must still be seen as new, or run() would wait for it forever.
  void loop(int tid, uint64_t seen) {
    for (;;) {
      const std::function<void(int, int)>* job;
      int threads;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_work_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        job = job_;
        threads = job_threads_;
      }
      if (tid >= threads) continue;
      (*job)(tid, threads);
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (--pending_ == 0) cv_done_.notify_one();
      }
    }
  }

  const pid_t pid_;
  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::vector<std::thread> workers_;
  std::atomic<int> size_{1};
  uint64_t generation_ = 0;
  const std::function<void(int, int)>* job_ = nullptr;
  int job_threads_ = 0;
  int pending_ = 0;
};

std::mutex g_pool_mu;
Pool* g_pool = nullptr;  // leaked at exit: detached workers may still be blocked on it

// fork() copies only the calling thread: if another thread held g_pool_mu at that instant, the
// child's copy would stay locked forever and its first kernel call would hang. Taking the lock
// in the prepare handler means no other thread holds it while fork() runs; parent and child
// (each with the forking thread as owner) release it afterwards.
void lock_pool_mu() { g_pool_mu.lock(); }
void unlock_pool_mu() { g_pool_mu.unlock(); }
[[maybe_unused]] const int g_atfork_registered = pthread_atfork(lock_pool_mu, unlock_pool_mu, unlock_pool_mu);

Pool& pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (g_pool == nullptr || g_pool->pid() != getpid()) g_pool = new Pool(affinity_cpu_count());
  return *g_pool;
}

}  // namespace

int pool_size() { return pool().size(); }

void set_pool_size(int n) {
  if (n < 1 || n > 1024) throw std::invalid_argument("thread count must be in [1, 1024]");
  pool().resize(n);
}

void debug_hold_pool_lock(double seconds) {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

void parallel_run(int nthreads, const std::function<void(int, int)>& fn) { pool().run(nthreads, fn); }

}  // namespace offload
