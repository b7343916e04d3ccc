// aio.h: the native asynchronous file I/O engine used for NVMe-resident optimizer state.
// A pool of worker threads runs pread/pwrite between files and caller-owned host buffers. A
// request (one contiguous file range) is cut into block_size pieces; up to queue_depth pieces
// are in flight at once (one per worker thread). Short transfers and EINTR are resumed; any other
// failure is recorded with errno, offset and length and reported when the caller waits. io_uring
// is not used (see docs/nvme.md): the build needs no liburing.
//
// Lifetimes: a File owns its descriptors. close() stops new requests at once, but the
// descriptors are closed only when the last request using them has finished, so a queued
// transfer can never reach another file that was given the same descriptor number.
// fork(): the worker threads exist only in the process that made the Engine. In a child every
// entry throws std::runtime_error (nothing is locked first: a parent thread may have held the
// mutex at fork time), and the destructor leaks the parent's state instead of joining threads
// that do not exist there.
#pragma once
#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace offload {
namespace aio {

enum Op : int { kRead = 0, kWrite = 1 };

// Alignment O_DIRECT transfers must respect here (offset, length and buffer address).
constexpr int64_t kDirectAlign = 4096;

// Test-only fault injection: the n-th system call from now misbehaves once.
enum Fault : int { kFaultNone = 0, kFaultEIO = 1, kFaultShort = 2, kFaultEINTR = 3 };

// Outcome of a finished request. err == 0: success, bytes == length. err > 0: errno of the
// first failing piece, which covered [err_offset, err_offset + err_length). err == kErrEOF:
// a read hit end of file before the request was complete.
struct Result {
  int64_t bytes = 0;
  int err = 0;
  int64_t err_offset = 0;
  int64_t err_length = 0;
};
constexpr int kErrEOF = -1;

struct Stats {
  int64_t bytes_read = 0, bytes_written = 0;
  int64_t requests = 0, pieces = 0, syscalls = 0;
  int64_t short_resumed = 0, eintr_resumed = 0, errors = 0;
};

// An open file: fd (O_DIRECT or not) plus an optional buffered tail_fd (same file) for the
// unaligned end of O_DIRECT transfers. Takes ownership of both descriptors. Lock-free (atomics
// only), so it stays usable in a forked child.
class File {
 public:
  File(int fd, int tail_fd);  // throws std::invalid_argument (descriptors then stay the caller's)
  ~File();                    // closes the descriptors if close() was never called
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  // No new requests from now on; the descriptors close when no request uses them any more.
  void close();
  bool closed() const { return closed_.load(); }
  int fd() const { return closed() ? -1 : fd_; }        // -1 once closed
  int tail_fd() const { return closed() ? -1 : tail_fd_; }
  bool direct() const { return direct_; }

 private:
  friend class Engine;
  bool acquire();  // a request starts using the descriptors; false if they are (being) closed
  void release();  // ... and is done with them; the last user closes them

  const int fd_, tail_fd_;
  int fl_ = 0, tail_fl_ = 0;
  bool direct_ = false;
  std::atomic<bool> closed_{false};
  std::atomic<int64_t> refs_{1};  // 1 while open + 1 per request in flight
};

class Engine {
 public:
  // queue_depth: worker threads = pieces in flight (1..256); block_size: piece size in bytes,
  // a positive multiple of kDirectAlign.
  Engine(int queue_depth, int64_t block_size);
  ~Engine();  // finishes every queued piece, then joins the workers (in a forked child: leaks)
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queue a transfer of len bytes between buf and file at offset off; returns a request id.
  // The caller keeps buf alive and untouched until wait() returned for the id. With an
  // O_DIRECT file, buf and off must be kDirectAlign-aligned; a length that is not a multiple
  // of kDirectAlign needs the file's tail_fd for the last piece.
  // Throws std::invalid_argument on bad arguments (nothing is queued then).
  int64_t submit(int op, const std::shared_ptr<File>& file, void* buf, int64_t len, int64_t off);
  // True once the request has finished (successfully or not). Unknown id: invalid_argument.
  bool poll(int64_t id);
  // Block until the request finishes or timeout_s passes (+inf: forever; negative or NaN:
  // invalid_argument). Returns false on timeout; otherwise fills *out and forgets the request.
  bool wait(int64_t id, double timeout_s, Result* out);
  // Requests submitted and not yet waited for.
  int64_t outstanding();
  void set_fault(int kind, int64_t nth);
  Stats stats();
  int queue_depth() const { return queue_depth_; }
  int64_t block_size() const { return block_size_; }
  pid_t owner_pid() const { return owner_; }

 private:
  struct Core;
  void check_process() const;  // std::runtime_error in a forked child

  const pid_t owner_;
  const int queue_depth_;
  const int64_t block_size_;
  Core* core_;  // owned; deliberately leaked in a forked child
};

}  // namespace aio
}  // namespace offload
